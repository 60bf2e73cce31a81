// `qflash chat`: a conversation on the terminal. Each line read is a user message; the answer
// streams back. The whole conversation is rendered with the model's chat template each turn and
// run by the batch engine, whose prefix cache still holds the earlier turns' KV (and, for hybrid
// models, Gated DeltaNet state snapshots), so a turn computes little more than its new text.
// Commands: /reset (forget the conversation), /exit (or end of input), /help. When the
// conversation and an answer would not fit the context or the KV cache, its oldest turns are
// dropped; a line that cannot be sent (not UTF-8, too long alone) is refused and the
// conversation goes on.
#pragma once

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <iostream>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "args.hpp"
#include "qflash/core/log.hpp"
#include "qflash/io/chat_template.hpp"
#include "qflash/io/detail/utf8.hpp"
#include "qflash/runtime/engine.hpp"
#include "qflash/runtime/load_model.hpp"

namespace qflash::cli {

struct ChatOptions {
  std::string system;     ///< a system message that starts every conversation
  int max_tokens = 512;   ///< per answer
  int context = 0;        ///< tokens of a sequence at most; 0: the model's
};

/// Drops the conversation's oldest exchange (its first user message and the answers up to the
/// next one) after the system message at `first`; false when only the last message is left.
inline bool drop_oldest_turn(io::ChatInput& chat, std::size_t first) {
  auto& m = chat.messages;
  if (m.size() <= first + 1) return false;
  m.erase(m.begin() + static_cast<std::ptrdiff_t>(first));
  while (m.size() > first + 1 && m[first].value("role", "") != "user") m.erase(m.begin() + static_cast<std::ptrdiff_t>(first));
  return true;
}

/// Runs the conversation on `in` until /exit or its end. `engine` and `chat_template` belong
/// to the model; sampling as resolved from the flags and generation_config.json.
inline int run_chat(runtime::Engine& engine, io::ChatTemplate const& chat_template, runtime::SamplingParams sampling,
                    ChatOptions const& o, std::istream& in) {
  bool const tty = ::isatty(0) != 0 && ::isatty(1) != 0;
  auto fresh = [&] {
    io::ChatInput c;
    c.add_generation_prompt = true;
    if (!o.system.empty()) c.messages.push_back({{"role", "system"}, {"content", o.system}});
    return c;
  };
  io::ChatInput chat = fresh();
  if (tty)
    std::fprintf(stderr, "qflash chat with %s: type a message, /reset to start over, /exit to quit\n",
                 engine.info().model_id.c_str());
  std::uint64_t turn = 0;
  for (std::string line;;) {
    if (tty) {
      std::fputs("> ", stdout);
      std::fflush(stdout);
    }
    if (!std::getline(in, line) || line == "/exit" || line == "/quit") break;
    if (line.empty()) continue;
    if (line == "/reset") {
      chat = fresh();
      if (tty) std::fputs("(the conversation starts over)\n", stderr);
      continue;
    }
    if (line == "/help") {
      std::fputs("/reset  forget the conversation\n/exit   quit (end of input too)\n", stdout);
      continue;
    }
    if (!io::detail::is_valid_utf8(line)) {
      std::fputs("qflash chat: the line is not valid UTF-8; it was not sent\n", stderr);
      continue;
    }
    // The conversation as sent: it replaces `chat` once the engine takes it. Its oldest turns go
    // while it would leave less than an answer's room in the context (at most half the
    // context), and while the engine refuses it (a prompt longer than the KV cache holds).
    io::ChatInput next = chat;
    next.messages.push_back({{"role", "user"}, {"content", line}});
    std::size_t const first = o.system.empty() ? 0 : 1;
    int const max_context = engine.info().max_context;
    std::int64_t const room = std::min(o.max_tokens, max_context / 2);
    auto request = [&] {
      runtime::GenerationRequest r;
      r.id = "chat-" + std::to_string(turn + 1);
      r.prompt = engine.tokenizer().encode(chat_template.render(next));
      r.max_tokens = o.max_tokens;
      r.sampling = sampling;
      r.sampling.seed = sampling.seed + turn + 1;
      return r;
    };
    runtime::GenerationRequest r = request();
    int dropped = 0;
    while (static_cast<std::int64_t>(r.prompt.size()) + room > max_context && drop_oldest_turn(next, first)) {
      ++dropped;
      r = request();
    }
    auto const t0 = std::chrono::steady_clock::now();
    std::shared_ptr<runtime::RequestStream> stream;
    while (!stream) {
      try {
        stream = engine.submit(std::move(r));
      } catch (runtime::RequestError const& e) {
        if (e.kind() != runtime::RequestErrorKind::kInvalid) throw;
        if (!drop_oldest_turn(next, first)) {
          std::fprintf(stderr, "qflash chat: %s; the message was not sent\n", e.what());
          break;
        }
        ++dropped;
        r = request();
      }
    }
    if (!stream) continue;
    ++turn;
    chat = std::move(next);
    if (dropped > 0 && chat.messages.size() == first + 1)
      std::fprintf(stderr, "(the earlier conversation was dropped to fit the context of %d tokens)\n", max_context);
    else if (dropped == 1)
      std::fprintf(stderr, "(the oldest turn was dropped to fit the context of %d tokens)\n", max_context);
    else if (dropped > 1)
      std::fprintf(stderr, "(the %d oldest turns were dropped to fit the context of %d tokens)\n", dropped, max_context);
    std::string answer;
    std::vector<runtime::ChoiceEvent> events;
    for (bool open = true; open;) {
      events.clear();
      open = stream->wait(events, std::chrono::milliseconds(100));
      for (auto const& e : events) {
        std::fwrite(e.text.data(), 1, e.text.size(), stdout);
        std::fflush(stdout);
        answer += e.text;
      }
    }
    std::fputs("\n", stdout);
    if (auto err = stream->error()) throw Error(*err, __FILE__, __LINE__);
    auto const usage = stream->usage();
    double const secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (tty)
      std::fprintf(stderr, "(%lld prompt tokens, %lld cached; %lld generated in %.2f s)\n",
                   static_cast<long long>(usage.prompt_tokens), static_cast<long long>(usage.cached_tokens),
                   static_cast<long long>(usage.completion_tokens), secs);
    else
      QFLASH_LOG_INFO("chat turn ", turn, ": ", usage.prompt_tokens, " prompt tokens, ", usage.cached_tokens,
                      " cached; ", usage.completion_tokens, " generated in ", secs, " s");
    chat.messages.push_back({{"role", "assistant"}, {"content", answer}});
  }
  return kExitOk;
}

}  // namespace qflash::cli
