"""Elastic meshes, a layer over the static mesh: a mesh that loses slices and gets them back.

- ``mesh``: ``ElasticMesh`` (recover, grow, epoch, fresh_ranks, last_recovery), ``init`` (the
  one branch of ``init_device_mesh(..., elastic=...)``), a restarted rank's ``join``,
  ``sync_replicas``;
- ``chain``: the chain of epochs on the world's Board (what follows each epoch, written once);
- ``session``: what an elastic job keeps in one world (the watcher, the finish at destroy);
- ``survivors``: the lost ranks, the same on every survivor; ``shrink``: the geometry, pure;
- ``recovery``: what an epoch change cost (``mesh.last_recovery``, the launcher's summary).

The static core offers it hooks and nothing else: ``World.open_epoch``, ``World.sever_epoch``,
``World.close_epoch``, and the world's ``epochs`` (``Epochs.layer``, ``at_destroy``,
``expect_losses``, ``admit``).
"""
