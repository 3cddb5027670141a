// One plan's run on the executor, shared by its parts (internal to run/): the step's live buffers
// by plan buffer id, its inputs, and what the handlers accumulate into its result.
#pragma once

#include <cstdint>
#include <mutex>
#include <vector>

#include "plan/arena.h"
#include "plan/plan.h"
#include "run/executor.h"
#include "tensor/memory.h"

namespace shardlm::run {

struct Executor::Run {
  const plan::Plan& plan;
  int64_t step;
  const StepInputs& in;
  std::vector<Buffer> live;  // by buffer id; each element is touched only by the tasks that own it
  std::mutex mu;
  StepResult result;
  double sum_squares = 0;
  std::vector<double> class_sums;  // this rank's squared-gradient sum per gradient class
  bool finiteness_known = false;  // norm_reduce has told every rank which ranks went non-finite
  std::vector<int64_t> moved;     // by task id: bytes an exchange sent to other ranks (-1: none)
  int64_t compute_micro = 0;      // the micro-step of the compute stream's task (its thread alone writes it)
  bool update_decided = false;    // decide_update has taken the norm and finiteness
  std::vector<double> unit_squares;  // this rank's squared-gradient sum per unit
  plan::ArenaLayout layout;          // where the buffers live in arena_ (empty: each allocated alone)
  char* data(int id) { return live.at(id).as<char>(); }
  float* f32(int id) { return id < 0 ? nullptr : live.at(id).f32(); }
};

}  // namespace shardlm::run
