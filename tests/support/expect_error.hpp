/// @file
/// Asserting that a call fails with a qflash::Error whose message names what it should.
#pragma once

#include <doctest/doctest.h>

#include <exception>
#include <initializer_list>
#include <string>

#include "qflash/core/error.hpp"

namespace qflash::test {

/// Runs `f`, which must throw qflash::Error whose message contains every part.
template <class F>
void expect_error(F&& f, std::initializer_list<std::string> parts) {
  try {
    f();
  } catch (Error const& e) {
    std::string const msg = e.what();
    for (auto const& p : parts) {
      INFO("message: ", msg);
      CHECK_MESSAGE(msg.find(p) != std::string::npos, "message lacks '", p, "'");
    }
    return;
  } catch (std::exception const& e) {
    FAIL("threw a non-qflash exception: ", e.what());
  }
  FAIL("no Error thrown (expected one mentioning '", *parts.begin(), "')");
}

}  // namespace qflash::test
