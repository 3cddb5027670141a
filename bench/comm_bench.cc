// Bus bandwidth of each collective, for every algorithm MpiCommunicator offers and for MPI's own
// blocking calls, so MpiCommunicator's `automatic` can use the fastest (see mpi_backend.h).
//
//   mpirun --oversubscribe -np 2 build/comm_bench [--sizes 4,16,64] [--iters 15] [--dtype fp32]
//          [--only all_reduce] [--impl direct,ring] [--wait-spin-us N --wait-max-sleep-us N]
//
// --only keeps one collective, --impl the implementations whose name contains one of the given
// words (e.g. `--only reduce_scatter --impl direct,ring` for a paired comparison of two).
//
// Sizes are MiB of the whole buffer S (all_gather: the gathered output; reduce_scatter and
// all_to_all: the input; all_reduce, broadcast: the buffer). Each iteration starts after a
// barrier and its time is the slowest rank's; the table shows the median and the minimum over
// iterations, and bandwidths from the median (and the busbw the minimum time gives).
// Bus bandwidth follows nccl-tests: all_reduce S/t·2(n−1)/n; all_gather, reduce_scatter,
// all_to_all S/t·(n−1)/n; broadcast S/t. MpiOptions other than the algorithm come from the
// environment (SHARDLM_COMM_CHUNK_KB, SHARDLM_COMM_WINDOW).
#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "comm/mpi_backend.h"
#include "comm/reduce.h"
#include "tensor/memory.h"

using namespace shardlm;
using namespace shardlm::comm;

namespace {

double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

struct Args {
  std::vector<int> sizes_mib = {4, 16, 64};
  int iters = 15;
  DType dtype = DType::fp32;
  std::string only;
  std::vector<std::string> impl_words;
  WaitPolicy wait;
};

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    std::string k = argv[i];
    auto val = [&]() -> std::string {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "missing value for %s\n", k.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (k == "--sizes") {
      a.sizes_mib.clear();
      std::stringstream ss(val());
      std::string s;
      while (std::getline(ss, s, ',')) a.sizes_mib.push_back(std::stoi(s));
    } else if (k == "--iters") {
      a.iters = std::stoi(val());
    } else if (k == "--dtype") {
      std::string d = val();
      a.dtype = d == "bf16" ? DType::bf16 : DType::fp32;
    } else if (k == "--only") {
      a.only = val();
    } else if (k == "--impl") {
      std::stringstream ss(val());
      std::string w;
      while (std::getline(ss, w, ',')) a.impl_words.push_back(w);
    } else if (k == "--wait-spin-us") {
      a.wait.spin = std::chrono::microseconds(std::stoi(val()));
    } else if (k == "--wait-max-sleep-us") {
      a.wait.max_sleep = std::chrono::microseconds(std::stoi(val()));
    } else {
      std::fprintf(stderr, "unknown argument %s\n", k.c_str());
      std::exit(2);
    }
  }
  return a;
}

MPI_Datatype mpi_type(DType d) { return d == DType::fp32 ? MPI_FLOAT : MPI_UINT16_T; }

// MPI's own reductions need an op; bf16 gets a user-defined one (the same function the backend
// registers).
MPI_Op bench_bf16_op() {
  static MPI_Op op = MPI_OP_NULL;
  if (op == MPI_OP_NULL) {
    MPI_Op_create(
        [](void* in, void* inout, int* len, MPI_Datatype*) { sum_into(DType::bf16, inout, in, *len); }, 1, &op);
  }
  return op;
}
MPI_Op mpi_sum(DType d) { return d == DType::fp32 ? MPI_SUM : bench_bf16_op(); }

void mpi_wait(MPI_Request* reqs, int n) {
  int done = 0;
  while (!done) MPI_Testall(n, reqs, &done, MPI_STATUSES_IGNORE);
}

}  // namespace

int main(int argc, char** argv) {
  init_mpi(&argc, &argv);
  const Args args = parse(argc, argv);
  int rank = 0, n = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  const DType dt = args.dtype;
  const int64_t es = dtype_size(dt);

  if (rank == 0) {
    std::printf("comm_bench: %d ranks, %s, %d iterations (slowest rank each)\n", n,
                to_string(dt), args.iters);
    std::printf("%-15s %-30s %6s %9s %9s %10s %10s %12s\n", "collective", "implementation", "MiB",
                "ms(med)", "ms(min)", "algbw GB/s", "busbw GB/s", "busbw(min t)");
  }

  struct Impl {
    std::string collective, name;
    double bus_factor;
    // Sets up for a total size (elements), returns the operation to time.
    std::function<std::function<void()>(int64_t)> make;
  };
  std::vector<Impl> impls;
  const double f1 = n > 1 ? double(n - 1) / n : 1.0, f2 = 2 * f1;

  // Buffers shared by all implementations, sized for the largest run.
  int64_t max_elems = 0;
  for (int s : args.sizes_mib) max_elems = std::max<int64_t>(max_elems, (int64_t(s) << 20) / es);
  MemoryPool memory;  // before the buffers and communicators, which it outlives
  Buffer a(memory, MemCategory::workspace, max_elems * es), b(memory, MemCategory::workspace, max_elems * es);
  for (int64_t i = 0; i < max_elems; ++i) {
    if (dt == DType::fp32) a.f32()[i] = 1.0f;
    else a.as<uint16_t>()[i] = float_to_bf16(1.0f);
  }
  char* A = a.as<char>();
  char* B = b.as<char>();

  std::vector<std::unique_ptr<MpiCommunicator>> keep;
  auto comm_with = [&](const char* coll, Algorithm algo) {
    MpiOptions o = mpi_options_from([](const char* name) { return std::getenv(name); });
    o.wait = args.wait;
    std::string c = coll;
    if (c == "all_gather") o.all_gather = algo;
    if (c == "reduce_scatter") o.reduce_scatter = algo;
    if (c == "all_reduce") o.all_reduce = algo;
    if (c == "all_to_all") o.all_to_all = algo;
    if (c == "broadcast") o.broadcast = algo;
    keep.push_back(std::make_unique<MpiCommunicator>(memory, o));
    return keep.back().get();
  };
  const std::chrono::milliseconds to(600'000);

  // all_reduce
  for (Algorithm al : {Algorithm::native, Algorithm::direct, Algorithm::ring}) {
    MpiCommunicator* c = comm_with("all_reduce", al);
    impls.push_back({"all_reduce", std::string("comm ") + to_string(al), f2, [=](int64_t e) {
                       return std::function<void()>([=] { c->all_reduce(A, e, dt, "bench")->wait(to); });
                     }});
  }
  impls.push_back({"all_reduce", "MPI_Allreduce (blocking)", f2, [=](int64_t e) {
                     return std::function<void()>([=] {
                       MPI_Allreduce(MPI_IN_PLACE, A, static_cast<int>(e), mpi_type(dt), mpi_sum(dt), MPI_COMM_WORLD);
                     });
                   }});
  // all_gather
  for (Algorithm al : {Algorithm::native, Algorithm::direct, Algorithm::ring}) {
    MpiCommunicator* c = comm_with("all_gather", al);
    impls.push_back({"all_gather", std::string("comm ") + to_string(al), f1, [=](int64_t e) {
                       return std::function<void()>([=] { c->all_gather(A, B, e / n, dt, "bench")->wait(to); });
                     }});
  }
  impls.push_back({"all_gather", "MPI_Allgather (blocking)", f1, [=](int64_t e) {
                     return std::function<void()>([=] {
                       MPI_Allgather(A, static_cast<int>(e / n), mpi_type(dt), B, static_cast<int>(e / n),
                                     mpi_type(dt), MPI_COMM_WORLD);
                     });
                   }});
  // reduce_scatter
  for (Algorithm al : {Algorithm::native, Algorithm::via_all_reduce, Algorithm::direct, Algorithm::ring}) {
    MpiCommunicator* c = comm_with("reduce_scatter", al);
    impls.push_back({"reduce_scatter", std::string("comm ") + to_string(al), f1, [=](int64_t e) {
                       return std::function<void()>([=] { c->reduce_scatter(A, B, e / n, dt, "bench")->wait(to); });
                     }});
  }
  impls.push_back({"reduce_scatter", "MPI_Reduce_scatter_block (blk)", f1, [=](int64_t e) {
                     return std::function<void()>([=] {
                       MPI_Reduce_scatter_block(A, B, static_cast<int>(e / n), mpi_type(dt), mpi_sum(dt),
                                                MPI_COMM_WORLD);
                     });
                   }});
  impls.push_back({"reduce_scatter", "MPI_Ireduce to each root", f1, [=](int64_t e) {
                     return std::function<void()>([=] {
                       const int64_t c = e / n;
                       std::vector<MPI_Request> reqs(n);
                       for (int q = 0; q < n; ++q) {
                         MPI_Ireduce(A + q * c * es, q == rank ? B : nullptr, static_cast<int>(c), mpi_type(dt),
                                     mpi_sum(dt), q, MPI_COMM_WORLD, &reqs[q]);
                       }
                       mpi_wait(reqs.data(), n);
                     });
                   }});
  // all_to_all
  for (Algorithm al : {Algorithm::native, Algorithm::direct}) {
    MpiCommunicator* c = comm_with("all_to_all", al);
    impls.push_back({"all_to_all", std::string("comm ") + to_string(al), f1, [=](int64_t e) {
                       return std::function<void()>([=] { c->all_to_all(A, B, e / n, dt, "bench")->wait(to); });
                     }});
  }
  impls.push_back({"all_to_all", "MPI_Alltoall (blocking)", f1, [=](int64_t e) {
                     return std::function<void()>([=] {
                       MPI_Alltoall(A, static_cast<int>(e / n), mpi_type(dt), B, static_cast<int>(e / n),
                                    mpi_type(dt), MPI_COMM_WORLD);
                     });
                   }});
  // broadcast
  for (Algorithm al : {Algorithm::native, Algorithm::direct}) {
    MpiCommunicator* c = comm_with("broadcast", al);
    impls.push_back({"broadcast", std::string("comm ") + to_string(al), 1.0, [=](int64_t e) {
                       return std::function<void()>([=] { c->broadcast(A, e, dt, 0, "bench")->wait(to); });
                     }});
  }
  impls.push_back({"broadcast", "MPI_Bcast (blocking)", 1.0, [=](int64_t e) {
                     return std::function<void()>(
                         [=] { MPI_Bcast(A, static_cast<int>(e), mpi_type(dt), 0, MPI_COMM_WORLD); });
                   }});
  impls.push_back({"memcpy", "memcpy S (one rank's copy)", 0.0, [=](int64_t e) {
                     return std::function<void()>([=] { std::memcpy(B, A, e * es); });
                   }});

  // Implementations take turns within each iteration, so load from other processes on a shared
  // machine falls on all of them alike.
  std::vector<Impl*> chosen;
  for (auto& impl : impls) {
    if (!args.only.empty() && impl.collective != args.only) continue;
    bool named = args.impl_words.empty();
    for (const auto& w : args.impl_words) named = named || impl.name.find(w) != std::string::npos;
    if (named) chosen.push_back(&impl);
  }
  for (int mib : args.sizes_mib) {
    const int64_t elems = ((int64_t(mib) << 20) / es) / n * n;  // divisible by n
    const double bytes = double(elems) * es;
    std::vector<std::function<void()>> ops;
    for (Impl* impl : chosen) {
      ops.push_back(impl->make(elems));
      ops.back()();  // warm-up (and first touch of staging)
    }
    std::vector<std::vector<double>> ts(chosen.size());
    for (int it = 0; it < args.iters; ++it) {
      for (size_t k = 0; k < chosen.size(); ++k) {
        MPI_Barrier(MPI_COMM_WORLD);
        const double t0 = now();
        ops[k]();
        double t = now() - t0, tmax = 0;
        MPI_Allreduce(&t, &tmax, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
        ts[k].push_back(tmax);
      }
    }
    for (size_t k = 0; k < chosen.size() && rank == 0; ++k) {
      std::sort(ts[k].begin(), ts[k].end());
      const double t = ts[k][ts[k].size() / 2], tmin = ts[k][0];
      const double alg = bytes / t / 1e9;
      std::printf("%-15s %-30s %6d %9.2f %9.2f %10.2f %10.2f %12.2f\n", chosen[k]->collective.c_str(),
                  chosen[k]->name.c_str(), mib, t * 1e3, tmin * 1e3, alg, alg * chosen[k]->bus_factor,
                  bytes / tmin / 1e9 * chosen[k]->bus_factor);
    }
    if (rank == 0) std::fflush(stdout);
  }
  keep.clear();
  finalize_mpi();
  return 0;
}
