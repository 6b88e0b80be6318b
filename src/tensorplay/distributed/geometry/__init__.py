"""Pure geometry: where each rank sits in a mesh, with no world, no engine and no store.

Imports only the standard library, numpy and ``errors`` (``tests/distributed/test_layers.py``
reads the imports); every query is O(ndim) at any world size, so a laptop answers for a
million ranks: on a (2, 4) mesh, rank 5 is at (1, 1) and its "tp" line is [4, 5, 6, 7].

- ``layout``: (size, stride) layouts: position <-> coordinate, select, flatten, unflatten;
- ``spec``: ``MeshSpec`` (layout + rank table + names), ``Ranks``, ``shift``, ``reshape``;
- ``roles``: dim roles and ``AbstractMesh``;
- ``topology``: host maps, groups that cross hosts, host-aware order, the advice text;
- ``shrink``: the elastic dim's slices removed after a loss and put back on a grow;
- ``describe``, ``plot``: the text report and the picture of a spec.
"""
