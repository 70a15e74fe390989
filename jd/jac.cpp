#include "jd/jac.h"

#include <memory>
#include <mutex>
#include <unordered_map>

namespace amp::jd {

namespace {
struct Entry {
  std::weak_ptr<TensorImpl> leaf;  // an entry whose leaf is gone is not its address's next tensor's
  Tensor jac;
};
std::mutex g_mutex;
std::unordered_map<const TensorImpl*, Entry>& table() {
  static std::unordered_map<const TensorImpl*, Entry> t;
  return t;
}
}  // namespace

Tensor jac(const Tensor& leaf) {
  std::lock_guard<std::mutex> lock(g_mutex);
  auto it = table().find(leaf.impl());
  if (it == table().end()) return Tensor();
  if (it->second.leaf.lock() != leaf.impl_ptr()) {
    table().erase(it);
    return Tensor();
  }
  return it->second.jac;
}

void set_jac(const Tensor& leaf, const Tensor& j) {
  std::lock_guard<std::mutex> lock(g_mutex);
  if (!j.defined()) {
    table().erase(leaf.impl());
    return;
  }
  // Before a new entry, the entries of leaves that are gone are dropped, so the table holds no dead
  // Jacobian; clearing (once per parameter per step) costs one lookup.
  if (table().find(leaf.impl()) == table().end())
    for (auto it = table().begin(); it != table().end();) it = it->second.leaf.expired() ? table().erase(it) : std::next(it);
  table()[leaf.impl()] = Entry{leaf.impl_ptr(), j};
}

}  // namespace amp::jd
