python -m benchmarks.fidelity_suite --tasks wordlm --workers 4 --seeds 0 --methods fp32,terngrad,terngrad:noclip:ef:block64 --jobs 2 --out <dir>   # coded.md
python -m benchmarks.fidelity_suite --tasks wordlm --workers 4 --seeds 0 --methods terngrad --set 'wordlm.classifier=embed.*' --out <dir>   # embedding_in_float.md
