/* A command's init without an interpreter: the steps spawn.py's forked init takes for a command whose
 * sandbox's server built its view (a folded command, sandboxes/folded.py), as one small program the
 * server starts with posix_spawn, so that no page of the server's is copied for it.
 *
 *   rollout-init NOFILE AS FSIZE OOM UID GID FRESH SECCOMP_HEX CWD N CANDIDATE... E VAR=VALUE... ARGV...
 *
 * with an empty environment of its own: the command's (E entries) comes as arguments, so that nothing
 * a C library reads from an environment at a program's start (GLIBC_TUNABLES, say) reaches a root one.
 * The server gives the view's mount namespace as fd 3 and its IPC namespace as fd 4, the command's stdio
 * as 0-2, and a session of its own. In order, as spawn._init and spawn._exec_command take them: every
 * signal unblocked and at its default; the descriptor and core limits; no CAP_SYS_ADMIN for what it
 * starts; the view's namespaces; no_new_privs and the seccomp filter seccomp.py made (its BPF as hex);
 * the working directory; the OOM score; the address-space and file-size limits; the sandbox's user (UID
 * -1: none) with a session keyring of its own (FRESH: the uid's kept keyrings emptied first); every
 * descriptor past stdio closed; then exec of the first CANDIDATE (the N places argv[0] may be, as execvpe
 * looks) that runs. A step before the working directory that fails exits 1 ("sandbox isolation: ..."); a
 * later one, or an exec that cannot run, exits 126, or 127 when no candidate exists, as a shell would.
 * Every message is one bounded line on stderr.
 *
 * Built with -DROLLOUT_NOLIBC on x86-64: no C library at all, its own system calls. A static glibc
 * program spends ~0.6 ms of CPU here before main (its start-up's CPUID probes, each a trap to the
 * hypervisor), against ~0.05 ms for the whole of one without it. Elsewhere, against the static glibc.
 */
#include <asm/unistd.h>
#include <linux/errno.h>
#include <linux/fcntl.h>
#include <linux/filter.h>
#include <linux/prctl.h>
#include <linux/resource.h>
#include <linux/sched.h>
#include <linux/seccomp.h>

#define MNT_FD 3
#define IPC_FD 4
#define MAX_FILTER 256
#define CAP_SYS_ADMIN 21
#define FIXED_ARGS 11 /* the program's name and the ten fields before the candidates */
#define MESSAGE_BYTES 512

#define KEYCTL_JOIN_SESSION_KEYRING 1
#define KEYCTL_CLEAR 7
#define KEYCTL_LINK 8
#define KEYCTL_UNLINK 9
#define KEYCTL_GET_PERSISTENT 22
#define KEY_SPEC_SESSION_KEYRING -3
#define KEY_SPEC_USER_KEYRING -4
#define KEY_SPEC_USER_SESSION_KEYRING -5

#ifdef ROLLOUT_NOLIBC
#ifndef __x86_64__
#error "the C-library-free build is for x86-64; build without ROLLOUT_NOLIBC elsewhere"
#endif
/* A system call's result, or minus its errno. */
static long call(long n, long a, long b, long c, long d, long e) {
    long ret;
    register long r10 __asm__("r10") = d;
    register long r8 __asm__("r8") = e;
    __asm__ volatile("syscall"
                     : "=a"(ret)
                     : "a"(n), "D"(a), "S"(b), "d"(c), "r"(r10), "r"(r8)
                     : "rcx", "r11", "memory");
    return ret;
}

/* What the compiler may call for a copy or a fill of its own. */
void *memcpy(void *to, const void *from, unsigned long n) {
    unsigned char *t = to;
    const unsigned char *f = from;
    while (n--)
        *t++ = *f++;
    return to;
}

void *memset(void *to, int c, unsigned long n) {
    unsigned char *t = to;
    while (n--)
        *t++ = (unsigned char)c;
    return to;
}
#else
#include <errno.h>
#include <unistd.h>
static long call(long n, long a, long b, long c, long d, long e) {
    long ret = syscall(n, a, b, c, d, e);
    return ret == -1 ? -errno : ret;
}
#endif

#define CALL0(n) call(n, 0, 0, 0, 0, 0)
#define CALL1(n, a) call(n, (long)(a), 0, 0, 0, 0)
#define CALL2(n, a, b) call(n, (long)(a), (long)(b), 0, 0, 0)
#define CALL3(n, a, b, c) call(n, (long)(a), (long)(b), (long)(c), 0, 0)
#define CALL4(n, a, b, c, d) call(n, (long)(a), (long)(b), (long)(c), (long)(d), 0)
#define CALL5(n, a, b, c, d, e) call(n, (long)(a), (long)(b), (long)(c), (long)(d), (long)(e))

static __attribute__((noreturn)) void leave(int code) {
    for (;;)
        CALL1(__NR_exit_group, code);
}

/* As the C library says them, for the errors a step here can meet; any other by its number. */
static const char *reason(int err) {
    switch (err) {
    case EPERM: return "Operation not permitted";
    case ENOENT: return "No such file or directory";
    case EIO: return "Input/output error";
    case E2BIG: return "Argument list too long";
    case ENOEXEC: return "Exec format error";
    case EBADF: return "Bad file descriptor";
    case EAGAIN: return "Resource temporarily unavailable";
    case ENOMEM: return "Cannot allocate memory";
    case EACCES: return "Permission denied";
    case EFAULT: return "Bad address";
    case ENOTDIR: return "Not a directory";
    case EISDIR: return "Is a directory";
    case EINVAL: return "Invalid argument";
    case ETXTBSY: return "Text file busy";
    case ENAMETOOLONG: return "File name too long";
    case ENOSYS: return "Function not implemented";
    case ELOOP: return "Too many levels of symbolic links";
    default: return 0;
    }
}

/* Appends ``text`` (at most ``limit`` bytes of it) to the line at ``*at``, within MESSAGE_BYTES - 1. */
static void append(char *line, int *at, const char *text, int limit) {
    for (int i = 0; text[i] && i < limit && *at < MESSAGE_BYTES - 1; i++)
        line[(*at)++] = text[i];
}

static void say(const char *first, const char *name, const char *last, int err) {
    char line[MESSAGE_BYTES];
    int at = 0;
    append(line, &at, first, 256);
    append(line, &at, name, 256);
    append(line, &at, last, 256);
    const char *why = reason(err);
    if (why) {
        append(line, &at, why, 64);
    } else {
        char digits[12];
        int n = 0, value = err < 0 ? -err : err;
        do
            digits[n++] = (char)('0' + value % 10);
        while ((value /= 10) && n < 11);
        append(line, &at, "error ", 6);
        while (n)
            append(line, &at, &digits[--n], 1);
    }
    line[at++] = '\n';
    CALL3(__NR_write, 2, line, at);
}

static __attribute__((noreturn)) void fail(const char *step, int err) {
    say("sandbox isolation: ", step, ": ", err);
    leave(1);
}

static __attribute__((noreturn)) void cannot_run(const char *name, int err) {
    say("cannot run '", name, "': ", err);
    leave(err == ENOENT ? 127 : 126);
}

/* A decimal field (a leading minus allowed); anything else ends the program. */
static long number(const char *text, const char *what) {
    int negative = *text == '-';
    const char *at = text + negative;
    long value = 0;
    if (!*at)
        fail(what, EINVAL);
    for (; *at; at++) {
        if (*at < '0' || *at > '9' || value > (0x7fffffffffffffffL - 9) / 10)
            fail(what, EINVAL);
        value = value * 10 + (*at - '0');
    }
    return negative ? -value : value;
}

/* Soft and hard limit ``kind`` set to ``value``; 0, or minus the errno. */
static long set_limit(int kind, long value) {
    struct rlimit64 limit = {(unsigned long long)value, (unsigned long long)value};
    return CALL4(__NR_prlimit64, 0, kind, &limit, 0);
}

static int unhex(char c) {
    if (c >= '0' && c <= '9')
        return c - '0';
    if (c >= 'a' && c <= 'f')
        return c - 'a' + 10;
    return -1;
}

static void install_filter(const char *hex) {
    static struct sock_filter ops[MAX_FILTER];
    unsigned long len = 0;
    while (hex[len])
        len++;
    if (len == 0 || len % (2 * sizeof ops[0]) || len / 2 > sizeof ops)
        fail("seccomp filter", EINVAL);
    unsigned char *bytes = (unsigned char *)ops;
    for (unsigned long i = 0; i < len / 2; i++) {
        int hi = unhex(hex[2 * i]), lo = unhex(hex[2 * i + 1]);
        if (hi < 0 || lo < 0)
            fail("seccomp filter", EINVAL);
        bytes[i] = (unsigned char)(hi << 4 | lo);
    }
    struct sock_fprog prog = {(unsigned short)(len / 2 / sizeof ops[0]), ops};
    long err = CALL5(__NR_prctl, PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &prog, 0, 0);
    if (err < 0)
        fail("seccomp filter", (int)-err);
}

/* As spawn._own_session_keyring: best effort, a kernel without keyrings has nothing to share. */
static void own_session_keyring(int fresh) {
    if (CALL2(__NR_keyctl, KEYCTL_JOIN_SESSION_KEYRING, 0) < 0)
        return;
    if (fresh) {
        CALL2(__NR_keyctl, KEYCTL_CLEAR, KEY_SPEC_USER_KEYRING);
        CALL2(__NR_keyctl, KEYCTL_CLEAR, KEY_SPEC_USER_SESSION_KEYRING);
        long persistent = CALL3(__NR_keyctl, KEYCTL_GET_PERSISTENT, -1, KEY_SPEC_SESSION_KEYRING);
        if (persistent >= 0) {
            CALL2(__NR_keyctl, KEYCTL_CLEAR, persistent);
            CALL3(__NR_keyctl, KEYCTL_UNLINK, persistent, KEY_SPEC_SESSION_KEYRING);
        }
    }
    CALL3(__NR_keyctl, KEYCTL_LINK, KEY_SPEC_USER_KEYRING, KEY_SPEC_SESSION_KEYRING);
}

/* Every signal unblocked and at its default: an ignored one stays ignored across exec, and posix_spawn
 * leaves the C library's own two (SIGCANCEL, SIGSETXID) ignored. All zero is SIG_DFL with no flags and
 * no mask in every layout of the kernel's structure. */
static void default_signals(void) {
    unsigned long none[4] = {0, 0, 0, 0};
    CALL4(__NR_rt_sigprocmask, 2 /* SIG_SETMASK */, none, 0, 8);
    for (int sig = 1; sig <= 64; sig++)
        CALL4(__NR_rt_sigaction, sig, none, 0, 8);
}

static int run(int argc, char **argv) {
    if (argc < FIXED_ARGS + 3)
        fail("arguments", EINVAL);
    long nofile = number(argv[1], "descriptor limit");
    long as = number(argv[2], "address-space limit");
    long fsize = number(argv[3], "file-size limit");
    long oom = number(argv[4], "OOM score");
    long uid = number(argv[5], "uid");
    long gid = number(argv[6], "gid");
    long fresh = number(argv[7], "fresh uid");
    const char *filter = argv[8];
    const char *cwd = argv[9];
    long n = number(argv[10], "candidates");
    if (n < 1 || n > argc - FIXED_ARGS - 2)
        fail("candidates", EINVAL);
    char **candidates = argv + FIXED_ARGS;
    char **slot = candidates + n; /* E, then the E entries */
    long vars = number(*slot, "environment");
    if (vars < 0 || vars > argc - FIXED_ARGS - n - 2)
        fail("environment", EINVAL);
    char **command = slot + 1 + vars; /* at least one entry: the bounds above */
    /* The entries moved one place down, over E, and ended: the environment the command gets. */
    for (long i = 0; i < vars; i++)
        slot[i] = slot[i + 1];
    slot[vars] = 0;
    char **env = slot;
    long err;

    default_signals();
    if ((err = set_limit(RLIMIT_NOFILE, nofile)) < 0)
        fail("descriptor limit", (int)-err);
    if ((err = set_limit(RLIMIT_CORE, 0)) < 0)
        fail("core limit", (int)-err);
    if ((err = CALL5(__NR_prctl, PR_CAPBSET_DROP, CAP_SYS_ADMIN, 0, 0, 0)) < 0)
        fail("capability bound", (int)-err);
    if ((err = CALL2(__NR_setns, MNT_FD, CLONE_NEWNS)) < 0)
        fail("the view's mount namespace", (int)-err);
    if ((err = CALL2(__NR_setns, IPC_FD, CLONE_NEWIPC)) < 0)
        fail("the view's IPC namespace", (int)-err);
    if ((err = CALL5(__NR_prctl, PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)) < 0)
        fail("no_new_privs", (int)-err);
    if (!(filter[0] == '-' && filter[1] == 0))
        install_filter(filter);

    if ((err = CALL1(__NR_chdir, cwd)) < 0)
        cannot_run(command[0], (int)-err);
    if (oom) {
        long fd = CALL4(__NR_openat, AT_FDCWD, "/proc/self/oom_score_adj", O_WRONLY | O_CLOEXEC, 0);
        if (fd < 0)
            cannot_run(command[0], (int)-fd);
        if ((err = CALL3(__NR_write, fd, "1000", 4)) != 4)
            cannot_run(command[0], err < 0 ? (int)-err : EIO);
        CALL1(__NR_close, fd);
    }
    if ((as > 0 && (err = set_limit(RLIMIT_AS, as)) < 0) ||
        (fsize > 0 && (err = set_limit(RLIMIT_FSIZE, fsize)) < 0))
        cannot_run(command[0], (int)-err);
    if (uid >= 0) {
        if ((err = CALL2(__NR_setgroups, 0, 0)) < 0 || (err = CALL3(__NR_setresgid, gid, gid, gid)) < 0 ||
            (err = CALL3(__NR_setresuid, uid, uid, uid)) < 0)
            cannot_run(command[0], (int)-err);
        own_session_keyring(fresh != 0);
    }
    if (CALL3(__NR_close_range, 3, ~0U, 0) < 0)
        for (int fd = 3; fd < 65536; fd++)
            CALL1(__NR_close, fd);
    int denied = 0;
    for (long i = 0; i < n; i++) {
        err = CALL3(__NR_execve, candidates[i], command, env);
        if (err != -ENOENT && err != -ENOTDIR && !denied)
            denied = (int)-err;
    }
    cannot_run(command[0], denied ? denied : ENOENT);
}

#ifdef ROLLOUT_NOLIBC
/* The kernel's entry: argc at the stack pointer, argv just above it. */
__attribute__((used, noreturn)) static void begin(long *stack) {
    leave(run((int)stack[0], (char **)(stack + 1)));
}
__asm__(".text\n"
        ".global _start\n"
        "_start:\n"
        "    xor %rbp, %rbp\n"
        "    mov %rsp, %rdi\n"
        "    and $-16, %rsp\n"
        "    call begin\n"
        "    hlt\n");
#else
int main(int argc, char **argv) {
    return run(argc, argv);
}
#endif
