make train            # -> ethernet-1g.txt (build/train-logs/rank0.log)
make train LINK=local # -> local.txt
# AMD EPYC, AVX2 without AVX-512, 2 cores; the tree of the commit that adds this folder
