/* eyas CPU kernels: which instruction-set variant the kernels run (kernels.h: "instruction sets").
 * The CPU's features are read with cpuid (__builtin_cpu_supports, which also checks that the OS saves the AVX and
 * AVX-512 registers) once, when the library loads; the best level the CPU has is used unless eyas_isa_select names
 * another one the CPU has. */
#include "kernels.h"

static const char *const NAMES[] = {"portable", "avx2", "avx512vnni"};
#define NLEVELS ((int)(sizeof(NAMES) / sizeof(NAMES[0])))

int eyas_isa_level = EYAS_ISA_PORTABLE;

static int has_level(int level) {
    if (level == EYAS_ISA_PORTABLE) return 1;
#ifdef EYAS_X86
    __builtin_cpu_init();
    const int avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    if (level == EYAS_ISA_AVX2) return avx2;
    if (level == EYAS_ISA_AVX512VNNI)
        return avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
               __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
#endif
    return 0;
}

static int level_of(const char *name) {
    for (int i = 0; name && i < NLEVELS; i++)
        if (strcmp(name, NAMES[i]) == 0) return i;
    return -1;
}

__attribute__((constructor)) static void isa_init(void) {
    for (int i = NLEVELS - 1; i >= 0; i--)
        if (has_level(i)) {
            eyas_isa_level = i;
            return;
        }
}

/* 1 when `name` is a level this build knows and this CPU runs, else 0 */
int eyas_isa_supported(const char *name) {
    const int i = level_of(name);
    return i >= 0 && has_level(i);
}

/* use level `name` from now on: 0; 1 for a name this build does not know, 2 for a level this CPU lacks (the level
 * in use stays). Call it between kernel calls, never during one. */
int eyas_isa_select(const char *name) {
    const int i = level_of(name);
    if (i < 0) return 1;
    if (!has_level(i)) return 2;
    eyas_isa_level = i;
    return 0;
}

const char *eyas_isa_name(void) { return NAMES[eyas_isa_level]; }

/* the names this build knows, best last, separated by commas */
const char *eyas_isa_names(void) { return "portable,avx2,avx512vnni"; }
