"""Device profiling scripts for the attention kernels (run by hand on a GPU host, not by
pytest): h200_smoke.py checks the CUDA kernels against the reference and times them;
h200_profile.py breaks a decode call into its parts and sweeps DirectTuning values.
"""
