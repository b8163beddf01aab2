"""The wire: the only place in the library that calls torch.distributed's collectives.

``collectives`` (a ``Communicator`` per process group: every collective FSDP runs, its wire
record and phase) and ``collective_check`` (the opt-in check that every rank is about to run the
same collective). ``tests/test_architecture.py`` enforces that no other module calls them.
"""
