"""The bottom floor: what more than one plane needs, importing no plane.

Wire-level types and limits (sampling parameters, request limits, packed deltas), TLS,
gRPC health, model paths and the server config base. Floors import downward only:
``hetero_proto`` < ``hetero_common`` < the three planes (``compute_plane``,
``control_plane``, ``gateway``, never importing each other) < ``hetero_infer`` (entry
points) and ``benchmarks``. ``tests/test_layers.py`` keeps it so.
"""
