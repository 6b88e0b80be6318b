"""The DeviceMesh value over a joined world: its queries, views, groups and torch conversion.

- ``args``: mesh-call arguments canonicalised at the door (shape, names, dims, backends);
- ``value``: ``DeviceMesh`` itself.
"""
