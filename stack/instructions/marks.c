/* Callgrind client requests for stack.instructions.workloads, loaded with ctypes.
 *
 * Python cannot issue a client request itself (it is a magic instruction sequence), and the
 * workload's Python start-up and `import torch` cost billions of instructions that must not be
 * counted: the run starts with instrumentation off (--instr-atstart=no), switches it on once
 * everything is imported and warmed up, and writes one profile dump per measured stage.
 * Outside valgrind every request is a no-op of a few instructions.
 * Reference: the Callgrind manual, "Client request reference" (valgrind.org/docs/manual/cl-manual.html).
 */
#include <string.h>
#include <valgrind/callgrind.h>

/* Twice the simulated last-level cache: writing it all evicts every line a stage before left there, so each
 * stage starts from the same cold cache whatever ran before it (zeroing the counts leaves the cache as it was).
 * Not static: the stores must not be optimised away. */
char stack_instr_evict_buffer[16 << 20];

void stack_instr_start(void) { CALLGRIND_START_INSTRUMENTATION; }

void stack_instr_zero(void) { CALLGRIND_ZERO_STATS; }

void stack_instr_dump(const char *stage) { CALLGRIND_DUMP_STATS_AT(stage); }

void stack_instr_evict(void) {
  static int round;
  memset(stack_instr_evict_buffer, ++round, sizeof stack_instr_evict_buffer);
}

int stack_instr_running_on_valgrind(void) { return RUNNING_ON_VALGRIND; }
