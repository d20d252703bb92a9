// PRECAST_CHECK: internal invariants. A failed check throws (never aborts), so a bug in
// one request's bookkeeping surfaces as an error instead of killing the server.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>

namespace precast {

class InvariantError : public std::logic_error {
 public:
  using std::logic_error::logic_error;
};

}  // namespace precast

#define PRECAST_CHECK(cond, msg)                                                               \
  do {                                                                                         \
    if (!(cond)) {                                                                             \
      std::ostringstream precast_check_os;                                                     \
      precast_check_os << __FILE__ << ":" << __LINE__ << ": check failed: " #cond ": " << msg; \
      throw ::precast::InvariantError(precast_check_os.str());                                 \
    }                                                                                          \
  } while (0)
