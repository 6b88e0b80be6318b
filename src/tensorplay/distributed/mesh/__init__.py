"""The DeviceMesh value over a joined world: its queries, views, groups and torch conversion.

- ``args``: mesh-call arguments canonicalised at the door (shape, names, dims, backends);
- ``parts``: ``MeshParts``, what a mesh is made of: the interface of the layers over it;
- ``value``: ``DeviceMesh`` itself: the value, its queries, ``shift``, ``get_group``, reports;
- ``views``: the meshes made from a mesh: slices, ``flatten``, ``unflatten``, ``reshape``;
- ``groups``: a mesh's groups, made through the world's registry or adopted;
- ``native``: the mesh as its engine's own mesh object (torch's DeviceMesh), both ways.
"""
