"""The public API: the drop-in collectives and point-to-point, groups and meshes, shared buffers
and ``explain``. ``import commlib`` exports all of it."""
