"""The state plane: the shared-memory segment the workers publish into and the router reads.

Layer rule: imports only :mod:`dplb.config` and :mod:`dplb.errors` (checked by ``tests/test_layers.py``).
- :mod:`dplb.state.layout`: the header, path rules and the router registry.
- :mod:`dplb.state.shm`: the segment, the worker slots (seqlock) and the byte layout.
- :mod:`dplb.state.segment_file`: making, validating and mapping the segment's file.
- :mod:`dplb.state.router_slots`: the router slots and prefix rings after the worker slots.
- :mod:`dplb.state.segments`: listing, inspecting and taking over segments on the host.
"""
