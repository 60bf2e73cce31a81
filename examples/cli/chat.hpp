// `qflash chat`: a conversation on the terminal. Each line read is a user message; the answer
// streams back. The whole conversation is rendered with the model's chat template each turn and
// run by the batch engine, whose prefix cache still holds the earlier turns' KV (and, for hybrid
// models, Gated DeltaNet state snapshots), so a turn computes little more than its new text.
// Commands: /reset (forget the conversation), /exit (or end of input), /help.
#pragma once

#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <iostream>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "args.hpp"
#include "qflash/io/chat_template.hpp"
#include "qflash/runtime/engine.hpp"
#include "qflash/runtime/load_model.hpp"

namespace qflash::cli {

struct ChatOptions {
  std::string system;     ///< a system message that starts every conversation
  int max_tokens = 512;   ///< per answer
};

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
    chat.messages.push_back({{"role", "user"}, {"content", line}});
    runtime::GenerationRequest r;
    r.id = "chat-" + std::to_string(++turn);
    r.prompt = engine.tokenizer().encode(chat_template.render(chat));
    r.max_tokens = o.max_tokens;
    r.sampling = sampling;
    r.sampling.seed = sampling.seed + turn;
    auto const t0 = std::chrono::steady_clock::now();
    auto stream = engine.submit(std::move(r));
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
    chat.messages.push_back({{"role", "assistant"}, {"content", answer}});
  }
  return kExitOk;
}

}  // namespace qflash::cli
