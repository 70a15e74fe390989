// The emulated GPU's dry run (emu.h): the switch, and device memory that is reserved, never touched.
#include <sys/mman.h>

#include <cstdlib>
#include <cstring>

#include "device.h"
#include "emu.h"

namespace amp::emu {

bool dry_run() {
  static const bool on = [] {
    const char* v = std::getenv("AMP_EMU_DRY_RUN");
    return v != nullptr && std::strcmp(v, "1") == 0;
  }();
  return on;
}

// Anonymous pages are not backed until written (MAP_NORESERVE: nor counted against swap), and the
// dry run writes none: only page tables for what is read (zeros), which nothing in it reads.
void* reserve_device_memory(size_t bytes) {
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  return p == MAP_FAILED ? nullptr : p;
}

void release_device_memory(void* p, size_t bytes) { munmap(p, bytes); }

}  // namespace amp::emu
