// Must NOT compile: Model<S, Arch> is a type for any arch tag, but running it needs launchers,
// and an arch that no op implements stops the build at the first op's static_assert, which
// names the op (tests/CMakeLists.txt checks the message), not at "no matching function".
#include <span>
#include <string_view>
#include <vector>

#include "qflash/model/model.hpp"

/// A GPU generation no kernel is written for.
struct Sm120 {
  static constexpr std::string_view name = "sm120";
  static constexpr bool is_cuda = true;
};

using FutureModel = qflash::model::Model<qflash::spec::generic, Sm120>;
static_assert(sizeof(FutureModel) > 0, "the type exists for every arch");

void run(FutureModel& m, std::span<qflash::model::SequenceChunk const> batch, std::vector<float>& logits) {
  m.forward(batch, qflash::model::LogitsFor::kLastToken, logits);
}
