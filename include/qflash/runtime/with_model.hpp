/// @file
/// A loaded model run as the compiled instance that fits it: loading (load_model.hpp) needs no
/// generated code; this header needs the generated instance list (dispatch.hpp).
#pragma once

#include <string>
#include <utility>

#include "qflash/arch/arch.hpp"
#include "qflash/core/error.hpp"
#include "qflash/runtime/dispatch.hpp"
#include "qflash/runtime/load_model.hpp"

namespace qflash::runtime {

/// Builds the model as the compiled spec that runs it (runtime/dispatch.hpp: an exact static
/// instance, else a dynamic one with one log line naming the spec to build) and calls
/// fn(model). Throws when no compiled spec runs it.
template <class Arch = arch::Cpu, class Fn>
void with_model(LoadedModel m, model::ModelOptions const& opts, Fn&& fn) {
  MoeSpec const rt = m.spec();
  std::string const source = m.config.source;
  Status const s = dispatch_spec(rt, [&](auto spec) {
    auto model = make_model<decltype(spec)::value, Arch>(std::move(m), opts);
    fn(*model);
    return Status::kSuccess;
  });
  QFLASH_CHECK(s == Status::kSuccess, source, ": no compiled instance runs this model (", to_string(s),
               "); compiled specs: ", compiled_spec_names());
}

}  // namespace qflash::runtime
