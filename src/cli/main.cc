#include "cli/commands.h"
#include "train/guard.h"

int main(int argc, char** argv) {
  shardlm::train::route_stop_signals();  // before any thread: see its comment
  return shardlm::cli::run(argc, argv);
}
