// Setting up and ending an MPI job, without MPI's headers: what a program that only picks a
// communicator (comm/factory.h) needs around it. Implemented in mpi_backend.cc.
#pragma once

namespace shardlm::comm {

// MPI_Init_thread with MPI_THREAD_MULTIPLE (the executor issues collectives from a comm thread
// while others test them). Throws Error, after finalizing, if the library grants less. Calling it
// again, or after the program initialised MPI itself with MPI_THREAD_MULTIPLE, is harmless.
// argc/argv may be null.
void init_mpi(int* argc, char*** argv);
// MPI_Finalize, if init_mpi initialised MPI and it is not finalized yet. Every MpiCommunicator
// must be destroyed and every collective complete before this.
void finalize_mpi();
// True between init_mpi (or the program's own MPI_Init_thread) and finalize.
bool mpi_active();
// Ends the whole job with `code`: MPI_Abort on MPI_COMM_WORLD when MPI is active (mpirun then
// kills every rank), else std::_Exit(code).
[[noreturn]] void abort_job(int code);

}  // namespace shardlm::comm
