# Sourced by the device scripts (ranks_run.sh, scratch_run.sh) with D the directory
# bench/cuda/ranks_pack.sh packed: the carried libraries before the machine's CUDA 13 runtime,
# cuBLAS and NCCL (found in its own install), and the carried Open MPI and PMIx.
CUB=$(dirname "$(find / -xdev -name 'libcublas.so.13*' 2>/dev/null | head -1)")
CRT=$(dirname "$(find / -xdev -name 'libcudart.so.13*' 2>/dev/null | head -1)")
NCCL=$(dirname "$(find / -xdev -name 'libnccl.so.2*' -not -path '/tmp/*' 2>/dev/null | head -1)")  # NCCL builds link it
export LD_LIBRARY_PATH=$D/lib:$CUB:$CRT:$NCCL:$LD_LIBRARY_PATH
export PATH=$D/bin:$PATH OPAL_PREFIX=$D/ompi PMIX_PREFIX=$D/pmix PMIX_PKGDATADIR=$D/pmix/share/pmix PMIX_PKGLIBDIR=$D/pmix/lib/pmix
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
# One machine, no ssh: the isolated launcher; shared memory without CMA (containers refuse ptrace).
export OMPI_MCA_plm=isolated OMPI_MCA_pml=ob1 OMPI_MCA_btl=self,vader,tcp OMPI_MCA_btl_vader_single_copy_mechanism=none
export OMPI_MCA_rmaps_base_oversubscribe=1 OMPI_MCA_hwloc_base_binding_policy=none
