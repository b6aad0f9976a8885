"""mamba_ssm 2.3.2.post1's Triton SSD kernels (Apache-2.0, Tri Dao and Albert Gu): README.md says which files and
what was changed (imports only). lpdiff's glue is kernels/ssd_chunked.py."""
