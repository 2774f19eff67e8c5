// src/comm/ll_line.cuh: the 16-byte line of the one-shot exchanges (the peer communicator's
// all_gather, and the decode kernels' fused key exchange through a DeviceChannel): an 8-byte
// element travels as {low 4 bytes | epoch << 32, high 4 bytes | epoch << 32}.
#pragma once

#include <stdint.h>

namespace cpidx {
namespace ll {

// Bit of an error word raised when a reader waited past its timeout (kPeerErrorTimeout), the
// word's only bit. Each rank's word lies in its peer-mapped buffer: a reader that times out
// raises it in every rank's word (alarm_peer), so that no rank reads on unaware.
constexpr int32_t kTimeoutBit = 1;
// Every 512 uses of a slot (two consecutive uses, one per parity) its writer also stamps the
// current epoch into the slot's lines it does not use, so no line keeps an epoch older than
// ~512 uses and a 32-bit epoch never matches a stale line after it wraps (NCCL's LL cleaning).
constexpr uint32_t kCleanMask = 255;
__host__ __device__ inline bool clean_round(uint32_t uses) {
  return ((uses >> 1) & kCleanMask) == kCleanMask;
}

// NOTE: one 16-byte store of two 8-byte elements, each {payload 4 B, epoch 4 B} (little endian).
// Each 64-bit element of a vector access is single-copy atomic, so a reader that sees the
// epoch in an element also sees that element's payload: the line needs no fence and no flag.
// .relaxed.sys makes the store and the polling load morally strong at system scope (they are
// the same location seen from two GPUs), so the reader eventually observes it.
__device__ __forceinline__ void store_line(unsigned long long* p, unsigned long long lo,
                                           unsigned long long hi) {
  asm volatile("st.relaxed.sys.global.v2.b64 [%0], {%1, %2};" ::"l"(p), "l"(lo), "l"(hi)
               : "memory");
}

__device__ __forceinline__ void load_line(const unsigned long long* p, unsigned long long& lo,
                                          unsigned long long& hi) {
  asm volatile("ld.relaxed.sys.global.v2.b64 {%0, %1}, [%2];"
               : "=l"(lo), "=l"(hi)
               : "l"(p)
               : "memory");
}

__device__ __forceinline__ void store_element(unsigned long long* p, unsigned long long v,
                                              uint32_t epoch) {
  const unsigned long long flag = static_cast<unsigned long long>(epoch) << 32;
  store_line(p, (v & 0xffffffffull) | flag, (v >> 32) | flag);
}

__device__ __forceinline__ unsigned long long global_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ __forceinline__ int32_t read_error(const int32_t* error) {
  return *reinterpret_cast<const volatile int32_t*>(error);
}

// Raises the timeout bit in a peer's error word through its mapping. A store, not an atomic OR:
// atomics to peer memory need NVLink (PCIe peers may lack them), and the bit is the word's only
// one, so the store leaves the word its OR. Only ever a timeout's path.
__device__ __forceinline__ void alarm_peer(int32_t* peer_error) {
  asm volatile("st.relaxed.sys.global.b32 [%0], %1;" ::"l"(peer_error), "r"(kTimeoutBit)
               : "memory");
}

// One reader thread's bounded wait: after timeout_ns (globaltimer) it raises the error word's
// timeout bit and stops waiting (`raised`: its caller then alarms every peer); it also stops
// when another thread or rank raised it.
struct Waiter {
  int32_t* error;
  unsigned long long timeout_ns;
  unsigned long long start = 0;
  unsigned int polls = 0;
  bool gave_up = false;
  bool raised = false;  // this waiter timed out (not another thread or rank)

  // A null error word makes an inert waiter (never used to wait).
  __device__ Waiter(int32_t* e, unsigned long long t) : error(e), timeout_ns(t) {
    gave_up = error != nullptr && (read_error(error) & kTimeoutBit) != 0;
  }

  // Polls line p until both halves carry `epoch`: its element in *v and true, or false once
  // this waiter gave up.
  __device__ bool wait(const unsigned long long* p, uint32_t epoch, unsigned long long* v) {
    while (!gave_up) {
      unsigned long long a, b;
      load_line(p, a, b);
      if (static_cast<uint32_t>(a >> 32) == epoch && static_cast<uint32_t>(b >> 32) == epoch) {
        *v = (a & 0xffffffffull) | (b << 32);
        return true;
      }
      if ((++polls & 1023u) == 0) {
        const unsigned long long now = global_ns();
        if (start == 0) {
          start = now;
        } else if (now - start > timeout_ns) {
          atomicOr(error, kTimeoutBit);
          gave_up = raised = true;
        }
        if (read_error(error) & kTimeoutBit) gave_up = true;
      }
    }
    return false;
  }
};

}  // namespace ll
}  // namespace cpidx
