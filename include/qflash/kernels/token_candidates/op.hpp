/// @file
/// Each logits row reduced to what sampling reads of it: its k best tokens and its sums over
/// the whole vocabulary. A device model brings these back instead of the rows (a few hundred
/// bytes where a Qwen3.6 row is 1 MiB), and the sampler decides from them whenever they cover
/// its choice (runtime/sampler.hpp).
///
/// Row r reads l_i = logits[r * ld + i] for i < vocab, with the `excluded` ids read as -inf.
/// - ids / values [r, 0..k): the k best ids by (l_i descending, then i ascending) and their
///   l_i; past the vocabulary (k > vocab), id -1 and -inf.
/// - stats[r].max: l of the best id (-inf when every id is excluded).
/// - stats[r].log_norm: max + log Σ_i e^(l_i - max), the log-softmax's normaliser (fp64 sums).
/// - stats[r].mass: Σ_i e^((l_i - max) / T) with T = temperature[r] (1 where T <= 0 or no
///   temperatures), each term an fp32 exp summed in fp64: the sampler's softmax weights' sum.
/// - stats[r].non_finite: how many l_i are NaN or ±Inf before the exclusion (a row with any
///   has unspecified candidates and sums; the model reports it as an error).
/// The CPU sums in id order, as runtime's Sampler and the engine's log-probabilities do, so
/// they are bitwise theirs; CUDA sums in another order (and its expf is within 2 ulp).
#pragma once

#include <cstdint>

#include "qflash/arch/arch.hpp"
#include "qflash/core/config.hpp"
#include "qflash/core/status.hpp"
#include "qflash/spec/moe_spec.hpp"

namespace qflash::kernels {

/// The most candidates a row may ask for.
inline constexpr int kMaxTokenCandidates = 256;

struct CandidateStats {
  float max = 0.0f;
  float log_norm = 0.0f;
  double mass = 0.0;
  std::int64_t non_finite = 0;
};

struct TokenCandidatesArgs {
  float const* logits = nullptr;  // [rows, ld]
  std::int64_t rows = 0;
  std::int64_t ld = 0;  ///< floats between rows; 0: vocab
  int vocab = 0;
  int k = 0;  ///< candidates per row, in [1, kMaxTokenCandidates]
  float const* temperature = nullptr;      // [rows]; null: 1 for every row
  std::int32_t const* excluded = nullptr;  // [n_excluded] ids in [0, vocab), ascending, no repeats
  int n_excluded = 0;
  std::int32_t* ids = nullptr;     // [rows, k]
  float* values = nullptr;         // [rows, k]
  CandidateStats* stats = nullptr;  // [rows]
};

/// Checks everything but the excluded ids' order and range (a CUDA launch cannot read them on
/// the host). No spec field changes the op.
template <MoeSpec S>
[[nodiscard]] constexpr Status can_implement_token_candidates_shape(TokenCandidatesArgs const& a) {
  if (!a.logits || !a.ids || !a.values || !a.stats || a.rows < 0 || a.vocab <= 0 || a.k < 1 ||
      a.k > kMaxTokenCandidates || (a.ld != 0 && a.ld < a.vocab) || a.n_excluded < 0 ||
      (a.n_excluded > 0 && !a.excluded))
    return Status::kErrorInvalidProblem;
  return Status::kSuccess;
}

/// Checks arguments, the excluded ids included (host memory).
template <MoeSpec S>
[[nodiscard]] constexpr Status can_implement_token_candidates(TokenCandidatesArgs const& a) {
  if (Status s = can_implement_token_candidates_shape<S>(a); s != Status::kSuccess) return s;
  for (int i = 0; i < a.n_excluded; ++i)
    if (a.excluded[i] < 0 || a.excluded[i] >= a.vocab || (i > 0 && a.excluded[i] <= a.excluded[i - 1]))
      return Status::kErrorInvalidProblem;
  return Status::kSuccess;
}

/// Launchers, one overload per arch tag: cpu.hpp, and sm80.cuh / sm90a.cuh (device pointers;
/// the excluded ids are not checked there: the caller checks them where it makes them).
template <MoeSpec S>
Status launch_token_candidates(arch::Cpu, TokenCandidatesArgs const& args, stream_t stream = nullptr);
template <MoeSpec S>
Status launch_token_candidates(arch::Sm80, TokenCandidatesArgs const& args, stream_t stream);
template <MoeSpec S>
Status launch_token_candidates(arch::Sm90a, TokenCandidatesArgs const& args, stream_t stream);
template <MoeSpec S, class Arch>
  requires(!arch::implemented_by<Arch, arch::Cpu, arch::Sm80, arch::Sm90a>)
Status launch_token_candidates(Arch, TokenCandidatesArgs const&, stream_t = nullptr) {
  static_assert(dependent_false<Arch>, "kernels/token_candidates: no implementation for this arch");
  return Status::kErrorArchMismatch;
}

}  // namespace qflash::kernels
