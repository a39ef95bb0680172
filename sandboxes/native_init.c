/* A command's init without an interpreter: the steps spawn.py's forked init takes for a command whose
 * sandbox's server built its view (a folded command, sandboxes/folded.py), as one small program the
 * server starts with posix_spawn, so that no page of the server's is copied for it.
 *
 *   rollout-init NOFILE AS FSIZE OOM UID GID FRESH SECCOMP_HEX CWD N CANDIDATE... E VAR=VALUE... ARGV...
 *
 * with an empty environment of its own: the command's (E entries) comes as arguments, so that nothing
 * the C library reads from an environment at a program's start (GLIBC_TUNABLES, say) reaches a root one.
 * The server gives the view's mount namespace as fd 3 and its IPC namespace as fd 4, the command's stdio
 * as 0-2, a session of its own and default signals (posix_spawn's setsid and setsigdef). In order, as
 * spawn._init and spawn._exec_command take them: the descriptor and core limits; no CAP_SYS_ADMIN for
 * what it starts; the view's namespaces; no_new_privs and the seccomp filter seccomp.py made (its BPF
 * as hex); the working directory; the OOM score; the address-space and file-size limits; the sandbox's
 * user (UID -1: none) with a session keyring of its own (FRESH: the uid's kept keyrings emptied first);
 * every descriptor past stdio closed; then exec of the first CANDIDATE (the N places argv[0] may be, as
 * execvpe looks) that runs. A step before the working directory that fails exits 1 ("sandbox
 * isolation: ..."); a later one, or an exec that cannot run, exits 126, or 127 when no candidate exists,
 * as a shell would. Every message is one line on stderr.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#define MNT_FD 3
#define IPC_FD 4
#define MAX_FILTER 256
#define CAP_SYS_ADMIN 21
#define FIXED_ARGS 11 /* the program's name and the ten fields before the candidates */

#define KEYCTL_JOIN_SESSION_KEYRING 1
#define KEYCTL_CLEAR 7
#define KEYCTL_LINK 8
#define KEYCTL_UNLINK 9
#define KEYCTL_GET_PERSISTENT 22
#define KEY_SPEC_SESSION_KEYRING -3
#define KEY_SPEC_USER_KEYRING -4
#define KEY_SPEC_USER_SESSION_KEYRING -5

static void say(const char *what, const char *detail, int err) {
    char line[512];
    int n = snprintf(line, sizeof line, "%s%s: %s\n", what, detail, strerror(err));
    if (n > (int)sizeof line - 1) {
        n = sizeof line - 1;
        line[n - 1] = '\n';
    }
    if (n > 0 && write(2, line, (size_t)n) < 0) {
        /* nowhere left to say it */
    }
}

static _Noreturn void fail(const char *step, int err) {
    say("sandbox isolation: ", step, err);
    _exit(1);
}

static long long number(const char *text, const char *what) {
    char *end;
    errno = 0;
    long long value = strtoll(text, &end, 10);
    if (errno || *text == '\0' || *end != '\0')
        fail(what, EINVAL);
    return value;
}

static void set_limit(int kind, long long value, const char *what) {
    struct rlimit limit = {(rlim_t)value, (rlim_t)value};
    if (setrlimit(kind, &limit) != 0)
        fail(what, errno);
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
    size_t len = strlen(hex);
    if (len == 0 || len % (2 * sizeof ops[0]) || len / 2 > sizeof ops)
        fail("seccomp filter", EINVAL);
    unsigned char *bytes = (unsigned char *)ops;
    for (size_t i = 0; i < len / 2; i++) {
        int hi = unhex(hex[2 * i]), lo = unhex(hex[2 * i + 1]);
        if (hi < 0 || lo < 0)
            fail("seccomp filter", EINVAL);
        bytes[i] = (unsigned char)(hi << 4 | lo);
    }
    struct sock_fprog prog = {(unsigned short)(len / 2 / sizeof ops[0]), ops};
    if (prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &prog, 0, 0) != 0)
        fail("seccomp filter", errno);
}

/* As spawn._own_session_keyring: best effort, a kernel without keyrings has nothing to share. */
static void own_session_keyring(int fresh) {
    if (syscall(SYS_keyctl, KEYCTL_JOIN_SESSION_KEYRING, NULL) < 0)
        return;
    if (fresh) {
        syscall(SYS_keyctl, KEYCTL_CLEAR, KEY_SPEC_USER_KEYRING);
        syscall(SYS_keyctl, KEYCTL_CLEAR, KEY_SPEC_USER_SESSION_KEYRING);
        long persistent = syscall(SYS_keyctl, KEYCTL_GET_PERSISTENT, -1, KEY_SPEC_SESSION_KEYRING);
        if (persistent >= 0) {
            syscall(SYS_keyctl, KEYCTL_CLEAR, persistent);
            syscall(SYS_keyctl, KEYCTL_UNLINK, persistent, KEY_SPEC_SESSION_KEYRING);
        }
    }
    syscall(SYS_keyctl, KEYCTL_LINK, KEY_SPEC_USER_KEYRING, KEY_SPEC_SESSION_KEYRING);
}

/* Every signal at its default: an ignored one stays ignored across exec, and posix_spawn leaves the C
 * library's own two (SIGCANCEL, SIGSETXID) ignored, which its signal() will not touch, so the kernel's
 * call. All zero is SIG_DFL with no flags and no mask in every layout of its structure. */
static void default_signals(void) {
    unsigned long none[4] = {0, 0, 0, 0};
    for (int sig = 1; sig <= 64; sig++)
        syscall(SYS_rt_sigaction, sig, none, NULL, 8);
}

static _Noreturn void cannot_run(const char *name, int err) {
    char quoted[300];
    snprintf(quoted, sizeof quoted, "cannot run '%.256s'", name);
    say(quoted, "", err);
    _exit(err == ENOENT ? 127 : 126);
}

int main(int argc, char **argv) {
    if (argc < FIXED_ARGS + 1)
        fail("arguments", EINVAL);
    long long nofile = number(argv[1], "descriptor limit");
    long long as = number(argv[2], "address-space limit");
    long long fsize = number(argv[3], "file-size limit");
    int oom = (int)number(argv[4], "OOM score");
    long long uid = number(argv[5], "uid");
    long long gid = number(argv[6], "gid");
    int fresh = (int)number(argv[7], "fresh uid");
    const char *filter = argv[8];
    const char *cwd = argv[9];
    long long n = number(argv[10], "candidates");
    if (n < 1 || n > argc - FIXED_ARGS - 2)
        fail("candidates", EINVAL);
    char **candidates = argv + FIXED_ARGS;
    long long vars = number(candidates[n], "environment");
    if (vars < 0 || vars > argc - FIXED_ARGS - n - 2)
        fail("environment", EINVAL);
    char **env = calloc((size_t)vars + 1, sizeof *env);
    if (env == NULL)
        fail("environment", errno);
    memcpy(env, candidates + n + 1, (size_t)vars * sizeof *env);
    char **command = candidates + n + 1 + vars; /* at least one: the bounds above */

    sigset_t none;
    sigemptyset(&none);
    sigprocmask(SIG_SETMASK, &none, NULL);
    default_signals();
    set_limit(RLIMIT_NOFILE, nofile, "descriptor limit");
    set_limit(RLIMIT_CORE, 0, "core limit");
    if (prctl(PR_CAPBSET_DROP, CAP_SYS_ADMIN, 0, 0, 0) != 0)
        fail("capability bound", errno);
    if (setns(MNT_FD, CLONE_NEWNS) != 0)
        fail("the view's mount namespace", errno);
    if (setns(IPC_FD, CLONE_NEWIPC) != 0)
        fail("the view's IPC namespace", errno);
    if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0)
        fail("no_new_privs", errno);
    if (strcmp(filter, "-") != 0)
        install_filter(filter);

    if (chdir(cwd) != 0)
        cannot_run(command[0], errno);
    if (oom) {
        int fd = open("/proc/self/oom_score_adj", O_WRONLY | O_CLOEXEC);
        if (fd < 0 || write(fd, "1000", 4) != 4)
            cannot_run(command[0], errno);
        close(fd);
    }
    if (as > 0 && setrlimit(RLIMIT_AS, &(struct rlimit){(rlim_t)as, (rlim_t)as}) != 0)
        cannot_run(command[0], errno);
    if (fsize > 0 && setrlimit(RLIMIT_FSIZE, &(struct rlimit){(rlim_t)fsize, (rlim_t)fsize}) != 0)
        cannot_run(command[0], errno);
    if (uid >= 0) {
        if (setgroups(0, NULL) != 0 || setresgid((gid_t)gid, (gid_t)gid, (gid_t)gid) != 0 ||
            setresuid((uid_t)uid, (uid_t)uid, (uid_t)uid) != 0)
            cannot_run(command[0], errno);
        own_session_keyring(fresh);
    }
    if (syscall(SYS_close_range, 3, ~0U, 0) != 0)
        for (int fd = 3; fd < 65536; fd++)
            close(fd);
    int denied = 0;
    for (long long i = 0; i < n; i++) {
        execve(candidates[i], command, env);
        if (errno != ENOENT && errno != ENOTDIR && !denied)
            denied = errno;
    }
    cannot_run(command[0], denied ? denied : ENOENT);
}
