// Must NOT compile: Model<S, arch::Sm90a> is a type, but running it needs launchers that
// have no sm90a implementation yet, and each stops the build with a static_assert naming
// the op (tests/CMakeLists.txt checks the message).
#include <span>
#include <vector>

#include "qflash/model/model.hpp"

using Sm90aModel = qflash::model::Model<qflash::spec::generic, qflash::arch::Sm90a>;
static_assert(sizeof(Sm90aModel) > 0, "the type exists for every arch");

void run(Sm90aModel& m, std::span<qflash::model::SequenceChunk const> batch, std::vector<float>& logits) {
  m.forward(batch, qflash::model::LogitsFor::kLastToken, logits);
}
