# Library path on the device machine: carried Debian libraries first, then CUDA 13 runtime/cuBLAS from the Python install.
D=$(pwd)/.devcarry
CUB=$(dirname "$(find / -xdev -name 'libcublas.so.13*' 2>/dev/null | head -1)")
CRT=$(dirname "$(find / -xdev -name 'libcudart.so.13*' 2>/dev/null | head -1)")
export LD_LIBRARY_PATH=$D/lib:$CUB:$CRT:$LD_LIBRARY_PATH
echo "cublas from $CUB, cudart from $CRT"
