#include "cli/commands.h"

int main(int argc, char** argv) { return shardlm::cli::run(argc, argv); }
