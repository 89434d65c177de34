"""Imported last by the test forkserver (tests/dist_utils.PRELOAD): freezes the garbage collector's view of what the
server imported, so that a forked rank's ``gc.collect()`` walks only the objects the rank itself made. DeepSpeed's
ZeRO-3 init collects once per engine (zero/utils.defragment), and a spawn builds dozens of engines: each collection
walked the ~0.5M objects of the imports first."""
import gc

gc.freeze()
