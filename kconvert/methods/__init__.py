"""The methods that decide a matrix's compressed values: the OBS engine (GPTQ and SparseGPT),
its kernels and the Hessians it is given (docs/obs.md)."""
