"""The store keys of tensorplay-run: what the launchers of one job across nodes post in the
job's store, node 0's TCPStore or the job's etcd (``launcher/nodes.py``: the join, the
heartbeat, the verdict, the node news; ``launcher/liveness.py`` under etcd). The ranks' own
keys are in ``control/keys.py``; the two never meet (every rank key is under
``tensorplay/world_<k>/``; under etcd, under ``RANKS_PREFIX`` too).

Worked example, 2 nodes, node 1 claimed once and started: node 1 posts its claim count under
``tensorplay-run/claim/1`` (1), its JSON under ``tensorplay-run/node/1/1``, beats on
``tensorplay-run/beat/1/1``; node 0 posts ``tensorplay-run/started`` when both arrived.
"""

NODE_CLAIM = "tensorplay-run/claim/{node}"  # how many launchers claimed node index i (add)
NODE_INFO = "tensorplay-run/node/{node}/{claim}"  # the claim-th claimant of index i (JSON)
NODE_BEAT = "tensorplay-run/beat/{node}/{claim}"  # the heartbeat counter of node i's claim-th
# claimant (add; DONE when it ends): a replacement beats on a counter of its own
NODES_STARTED = "tensorplay-run/started"  # every node arrived: the ranks start
NODES_PARTED = "tensorplay-run/parted"  # how many launchers have left (add)
NODES_VERDICT = "tensorplay-run/verdict"  # why the job stops, the first written (JSON)
NODE_NEXT = "tensorplay-run/next/{node}/{claim}"  # the claim that replaced node i's lost
# claim-th claimant (compare_set: one replacement wins)
NODE_NEWS = "tensorplay-run/news"  # how many node losses and replacements were posted (add)
NODE_NEWS_ITEM = "tensorplay-run/news/{n}"  # the n-th of them (JSON), elastic mode only
NODE_LINKS = "tensorplay-run/links"  # "<port>": where node 0 holds a connection per launcher
NODE_LOST = "tensorplay-run/lost/{node}/{claim}"  # who posts the loss of node i's claim-th
# claimant (compare_set: one launcher posts the news, however many saw it)
# under --store etcd (launcher/liveness.py): every host equal
NODE_ALIVE = "tensorplay-run/alive/{node}/{claim}"  # held by a lease of node i's claim-th
# launcher (TTL --node-grace-s): it vanishes with that launcher, and every launcher's watch sees it
ALIVE_PREFIX = "tensorplay-run/alive/"
NODE_DONE = "tensorplay-run/done/{node}/{claim}"  # node i's claim-th launcher ended cleanly
NODE_SAW_ALL = "tensorplay-run/saw-all/{node}"  # store member i's launcher saw every node done:
# the members stop once each has (a member stopped earlier could cost another its majority)
NODE_LINKS_OF = "tensorplay-run/links/{node}"  # "<port>": where store member i's launcher holds
# a connection per launcher
JOB_ENDED = "tensorplay-run/ended"  # the job is over: a later launcher of the same --job-id is
# refused (a store the user runs outlives its jobs)
LAUNCHER_PREFIX = "tensorplay-run/"  # every key above; the ranks' keys are under RANKS_PREFIX
RANKS_PREFIX = "ranks/"
