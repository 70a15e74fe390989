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
  // Entries of leaves that are gone are dropped as they are met, so the table holds no dead Jacobian.
  for (auto it = table().begin(); it != table().end();) it = it->second.leaf.expired() ? table().erase(it) : std::next(it);
  if (!j.defined()) {
    table().erase(leaf.impl());
    return;
  }
  table()[leaf.impl()] = Entry{leaf.impl_ptr(), j};
}

}  // namespace amp::jd
