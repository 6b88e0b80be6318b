"""Elastic meshes, a layer over the static mesh: a mesh that loses slices and gets them back.

- ``mesh``: ``ElasticMesh`` (recover, grow, epoch, fresh_ranks, last_recovery), ``init`` (the
  one branch of ``init_device_mesh(..., elastic=...)``), a restarted rank's ``join``,
  ``sync_replicas``;
- ``chain``: the chain of epochs on the world's Board (what follows each epoch, written once);
- ``session``: what an elastic job keeps in one world (the watcher, the finish at destroy);
- ``survivors``: the lost ranks, the same on every survivor.

What it stands on, and calls: the geometry (``geometry/shrink.py``: ``shrink`` and ``grow``,
pure), the record of an epoch change (``host/wire.py``'s ``Recovery``, ``mesh.last_recovery``
and the launcher's summary), the control plane (``control/consensus.py``'s ``agree``, a
``Board``), the mesh value (``mesh/value.py``: ``DeviceMesh`` and its group making), and the
world: ``World.open_epoch``, ``sever_epoch``, ``close_epoch``, ``let_go``, ``members``, the
world's ``epochs`` (``Epochs.layer``, ``at_destroy``, ``expect_losses``, ``admit``), its
control plane's ``hosts``, and
``job/lifecycle.py``'s ``leave_unheard``.
"""
