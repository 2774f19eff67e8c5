// cpidx/device_channel.h: a one-shot exchange channel that the library's kernels write to and
// read from themselves, so that cp_decode fuses its key all-gather into the selection kernel
// (stores) and the merge kernel (polling) instead of running a gather kernel between them. The
// peer communicator (comm_peer.h) offers one; Communicator::device_channel() is nullptr for the
// others, and cp_decode then gathers the keys with all_gather.
//
// Protocol (one-shot LL stores, as the peer communicator's all_gather):
//  - Rank q's buffer is [2 parities][world sources][capacity lines][2] 64-bit words. A payload's
//    8-byte element j travels as line j of the writer's source slot, {low 4 bytes | epoch << 32,
//    high 4 bytes | epoch << 32}, one 16-byte store to every rank whose 8-byte halves are each
//    single-copy atomic: a reader that sees the epoch in both halves has the element. No fence,
//    no flag.
//  - Use k of the channel (k = *calls when it starts) writes epoch k + 1 (mod 2^32, never 0)
//    with parity k & 1. Every writer reads *calls before it lets the readers start (programmatic
//    dependent launch); the last reader to arrive resets *arrivals and sets *calls = k + 1.
//  - Back-pressure: a rank may start writing use k + 2 only after every reader finished use k
//    (the same parity). cp_decode guarantees it with its query all-gather, a collective that
//    every rank enters only after its previous step's merge completed.
//  - Every 512 uses a writer also stamps the current epoch into the lines of its slot past the
//    payload, so that no line keeps an epoch old enough to match again after the 32-bit epoch
//    wraps.
//  - A reader that waits longer than timeout_ns raises bit 1 of *error and stops waiting (its
//    results are then undefined); a reader that finds the bit set does not wait at all. Each
//    rank's error word is the 16-byte line after its buffer's channel lines (peer-mapped with
//    them): the reader that timed out raises the bit in every rank's word, so a rank one use
//    behind (it skipped a step) learns of it too.
#pragma once

#include <cstddef>
#include <cstdint>

#include "cpidx/contract.h"  // CPIDX_HD

namespace cpidx {

struct DeviceChannel {
  static constexpr int kMaxRanks = 8;
  unsigned long long* buffers[kMaxRanks] = {};  // rank q's buffer as mapped on this rank's GPU
  uint32_t* calls = nullptr;     // device word: uses completed so far
  uint32_t* arrivals = nullptr;  // device word: readers arrived in the current use (0 between)
  int32_t* error = nullptr;      // this rank's error word (bit 1: a reader timed out),
                                 // the line after its channel lines in buffers[rank]
  int64_t capacity = 0;          // lines per (parity, source): payloads up to capacity * 8 bytes
  unsigned long long timeout_ns = 0;
  int rank = 0, world = 0;       // world == 0: no channel
};

// 64-bit words of a rank's channel lines ([2][world][capacity][2] above). Rank q's error word
// starts the line after them, at buffers[q] + channel_words(world, capacity): where the peer
// communicator places it and where the kernels raise it.
constexpr CPIDX_HD size_t channel_words(int world, int64_t capacity) {
  return size_t{2} * static_cast<size_t>(world) * static_cast<size_t>(capacity) * 2;
}

}  // namespace cpidx
