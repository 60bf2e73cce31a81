/// @file
/// Fusion variants of Model<Spec, Arch, Fusion>: which adjacent steps of a layer run as one
/// kernel pass. Each choice is a type (like FlashInfer's attention variants), so a research
/// build instantiates two variants side by side and compares them; the math is the same, only
/// the rounding order of fp32 sums and the number of passes over memory differ.
/// docs/research.md lists these and the routing policies (model/routing.hpp) in one place.
///
///   Residual add (each layer adds its mixer's and its MoE block's output to the residual
///   stream h):
///     AddInNorm        fused into the next RMSNorm: one pass reads the output and h, writes
///                      h and the normed rows (the default; vLLM's fused_add_rms_norm)
///     AddInProjection  fused into the producing kernel's epilogue: the output projection and
///                      the experts' weighted combine accumulate straight into h; the norm
///                      that follows is a plain RMSNorm
///   Expert SwiGLU:
///     SwiGluInExperts  gate, up and silu(gate) * up in one pass per block of expert rows
///                      (the default)
///     SwiGluSeparate   the gate projection, the up projection and the SwiGLU each a pass of
///                      their own over every routed expert
#pragma once

#include <string>
#include <type_traits>

namespace qflash::fusion {

struct AddInNorm {
  static constexpr char const* name = "add+rmsnorm";
};
struct AddInProjection {
  static constexpr char const* name = "add-in-projection";
};
struct SwiGluInExperts {
  static constexpr char const* name = "swiglu-fused";
};
struct SwiGluSeparate {
  static constexpr char const* name = "swiglu-separate";
};

template <class T>
concept ResidualVariant = std::is_same_v<T, AddInNorm> || std::is_same_v<T, AddInProjection>;
template <class T>
concept SwiGluVariant = std::is_same_v<T, SwiGluInExperts> || std::is_same_v<T, SwiGluSeparate>;

/// One choice per fused step; `Variant<>` is what the engine runs.
template <ResidualVariant Residual = AddInNorm, SwiGluVariant SwiGlu = SwiGluInExperts>
struct Variant {
  using residual = Residual;
  using swiglu = SwiGlu;
  static constexpr bool add_in_norm = std::is_same_v<Residual, AddInNorm>;
  static constexpr bool fused_swiglu = std::is_same_v<SwiGlu, SwiGluInExperts>;

  /// "add+rmsnorm, swiglu-fused", for reports.
  static std::string name() { return std::string(Residual::name) + ", " + SwiGlu::name; }
};

using Default = Variant<>;

template <class T>
struct is_variant : std::false_type {};
template <class R, class G>
struct is_variant<Variant<R, G>> : std::true_type {};
template <class T>
concept FusionVariant = is_variant<T>::value;

}  // namespace qflash::fusion
