"""Retention (SPEC §8): ``plan`` holds the pure planners (the retention classes, the best
checkpoints, the disk budget) and the crash-safe executor that ``ckptpilot prune`` runs;
``auto`` applies them while the run trains, on the writer thread. Import from the modules.
"""
