/* A command's init without an interpreter: the steps spawn.py's forked init takes for a command whose
 * sandbox's server built its view (a folded command, sandboxes/folded.py), as one small program the
 * server starts with posix_spawn, so that no page of the server's is copied for it.
 *
 *   rollout-init NOFILE AS FSIZE OOM UID GID SECCOMP_HEX CWD N CANDIDATE... E VAR=VALUE... ARGV...
 *
 * with an empty environment of its own: the command's (E entries) comes as arguments, so that nothing
 * a C library reads from an environment at a program's start (GLIBC_TUNABLES, say) reaches a root one.
 * The server gives the view's mount namespace as fd 3 and its IPC namespace as fd 4, the command's stdio
 * as 0-2, and a session of its own. In order, as spawn._init and spawn._exec_command take them: every
 * signal unblocked and at its default; the descriptor and core limits; no CAP_SYS_ADMIN for what it
 * starts; the view's namespaces; no_new_privs and the seccomp filter seccomp.py made (its BPF as hex);
 * the working directory; the OOM score; the address-space and file-size limits; the sandbox's user (UID
 * -1: none); every descriptor past stdio closed; then exec of the first CANDIDATE (the N places argv[0]
 * may be, as execvpe looks) that runs. A step before the working directory that fails exits 1 ("sandbox
 * isolation: ..."); a later one, or an exec that cannot run, exits 126, or 127 when no candidate exists,
 * as a shell would. Every message is one bounded line on stderr.
 *
 *   rollout-init view SCRATCH_SIZE D DEVICE... L NAME TARGET... (KIND PATH EXTRA)...
 *
 * builds a sandbox's filesystem view instead, as sandboxes/fsview.py's clone_sources and apply do (they
 * stay the reference; a test holds the two to the same mounts), for a server that would otherwise build
 * it in its own interpreter: ~0.6 ms of CPU and ~125 of its pages copied in the burst of a thousand
 * sandboxes' starts, where this costs a posix_spawn and the system calls. The steps come as triples (an
 * empty EXTRA: none), the devices and /dev's links as fsview names them. The server gives the base mount
 * namespace as fd 3 and the detached procfs that becomes the view's /proc as fd 4, a pipe to say it is
 * built on 1, and one whose end means the server has opened its namespaces on 0. It clones the sources
 * from the server's (the host's) mount namespace, unshares a mount and IPC namespace from the base, builds
 * the view there and makes it its root over the base's (chroot, as fsview.apply), writes "1" and waits; a
 * step that fails exits 1 ("sandbox view: ...") and the server builds the view itself, which says why it
 * could not.
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
#include <linux/mount.h>
#include <linux/sched.h>
#include <linux/seccomp.h>
#include <linux/stat.h>

#define MNT_FD 3
#define IPC_FD 4
#define MAX_FILTER 256
#define CAP_SYS_ADMIN 21
#define FIXED_ARGS 10 /* the program's name and the nine fields before the candidates */
#define MESSAGE_BYTES 512
#define BASE_FD 3 /* the view's: the base mount namespace */
#define PROC_FD 4 /* the view's: its /proc */
#define PATH_BYTES 4096
#define MAX_STEPS 1024
#define MAX_DEVICES 16

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

/* Every signal unblocked and at its default: an ignored one stays ignored across exec, and posix_spawn
 * leaves the C library's own two (SIGCANCEL, SIGSETXID) ignored. All zero is SIG_DFL with no flags and
 * no mask in every layout of the kernel's structure. */
static void default_signals(void) {
    unsigned long none[4] = {0, 0, 0, 0};
    CALL4(__NR_rt_sigprocmask, 2 /* SIG_SETMASK */, none, 0, 8);
    for (int sig = 1; sig <= 64; sig++)
        CALL4(__NR_rt_sigaction, sig, none, 0, 8);
}

/* ---- the view ------------------------------------------------------------------------------------ */

static __attribute__((noreturn)) void view_failed(const char *step, const char *path, int err) {
    char what[320];
    int at = 0;
    append(what, &at, step, 64);
    append(what, &at, " ", 1);
    append(what, &at, path, 240);
    what[at] = 0;
    say("sandbox view: ", what, ": ", err);
    leave(1);
}

static long checked(long result, const char *step, const char *path) {
    if (result < 0)
        view_failed(step, path, (int)-result);
    return result;
}

/* statx's mode of ``path`` (``flags``: AT_SYMLINK_NOFOLLOW, AT_EMPTY_PATH), or -1 where there is none. */
static long mode_of(int dir, const char *path, int flags) {
    struct statx info;
    if (CALL5(__NR_statx, dir, path, flags, STATX_TYPE, &info) < 0)
        return -1;
    return info.stx_mode;
}

static int dir_mode(long mode) {
    return mode >= 0 && (mode & 0170000) == 0040000;
}

static int is_dir(const char *path) {
    return dir_mode(mode_of(AT_FDCWD, path, 0));
}

/* An O_PATH descriptor of ``path``: a mount to make read-only once what goes inside it is in. */
static long handle_of(const char *path) {
    return checked(CALL3(__NR_openat, AT_FDCWD, path, O_PATH | O_CLOEXEC), "open", path);
}

/* ``a`` then ``b`` into ``out``, or the view fails. */
static char *joined(char *out, const char *a, const char *b) {
    int at = 0;
    for (; *a; a++)
        if (at < PATH_BYTES - 1)
            out[at++] = *a;
    for (; *b; b++)
        if (at < PATH_BYTES - 1)
            out[at++] = *b;
    out[at] = 0;
    if (at >= PATH_BYTES - 1)
        view_failed("path", out, ENAMETOOLONG);
    return out;
}

/* os.makedirs(path, 0o755, exist_ok=True) of the directories above ``path`` (its last name left). */
static void make_parents(const char *path) {
    char prefix[PATH_BYTES];
    int at = 0;
    for (const char *c = path; *c && at < PATH_BYTES - 1; c++) {
        if (*c == '/' && at > 0 && mode_of(AT_FDCWD, (prefix[at] = 0, prefix), 0) < 0) {
            long err = CALL3(__NR_mkdirat, AT_FDCWD, prefix, 0755);
            if (err < 0 && err != -EEXIST)
                view_failed("mkdir", prefix, (int)-err);
        }
        prefix[at++] = *c;
    }
}

/* fsview._make_mount_point: an empty directory (or file) at ``path``, and its parents, unless there is
 * something there. */
static void make_mount_point(const char *path, int directory) {
    if (mode_of(AT_FDCWD, path, AT_SYMLINK_NOFOLLOW) >= 0)
        return;
    make_parents(path);
    if (directory) {
        checked(CALL3(__NR_mkdirat, AT_FDCWD, path, 0755), "mkdir", path);
    } else {
        long fd = checked(CALL4(__NR_openat, AT_FDCWD, path, O_WRONLY | O_CREAT | O_CLOEXEC, 0644), "create", path);
        CALL1(__NR_close, fd);
    }
}

static void set_attr(long fd, int flags, unsigned long set, unsigned long propagation, const char *path) {
    struct mount_attr attr = {set, 0, propagation, 0};
    checked(CALL5(__NR_mount_setattr, fd, "", AT_EMPTY_PATH | flags, &attr, sizeof attr), "mount_setattr", path);
}

static void move_to(long fd, const char *path) {
    checked(CALL5(__NR_move_mount, fd, "", AT_FDCWD, path, MOVE_MOUNT_F_EMPTY_PATH), "move_mount", path);
}

static long clone_of(const char *path) {
    return checked(CALL3(__NR_open_tree, AT_FDCWD, path, OPEN_TREE_CLONE | O_CLOEXEC), "open_tree", path);
}

static void mount_fs(const char *source, const char *path, const char *type, unsigned long flags, const char *data) {
    checked(CALL5(__NR_mount, source, path, type, flags, data), "mount", path);
}

/* A new tmpfs with ``options`` (key=value,...), attached nowhere: the descriptor of its mount. */
static long new_tmpfs(const char *mode, const char *size, unsigned long attrs) {
    long fs = checked(CALL2(__NR_fsopen, "tmpfs", FSOPEN_CLOEXEC), "fsopen", "tmpfs");
    checked(CALL5(__NR_fsconfig, fs, FSCONFIG_SET_STRING, "mode", mode, 0), "fsconfig", "mode");
    checked(CALL5(__NR_fsconfig, fs, FSCONFIG_SET_STRING, "size", size, 0), "fsconfig", "size");
    checked(CALL5(__NR_fsconfig, fs, FSCONFIG_CMD_CREATE, 0, 0, 0), "fsconfig", "create");
    long mnt = checked(CALL3(__NR_fsmount, fs, FSMOUNT_CLOEXEC, attrs), "fsmount", "tmpfs");
    CALL1(__NR_close, fs);
    return mnt;
}

static int same(const char *a, const char *b) {
    while (*a && *a == *b)
        a++, b++;
    return *a == *b;
}

/* Whether another step of the view lies inside step ``i``'s path (fsview._holds_a_step). */
static int holds_a_step(char **steps, long n_steps, long i) {
    for (long j = 0; j < n_steps; j++) {
        const char *top = steps[3 * i + 1], *path = steps[3 * j + 1];
        while (*top && *top == *path)
            top++, path++;
        if (j != i && !*top && *path == '/')
            return 1;
    }
    return 0;
}

static int build_view(int argc, char **argv) {
    if (argc < 5)
        view_failed("arguments", "", EINVAL);
    const char *scratch_size = argv[2];
    long n_devices = number(argv[3], "devices");
    if (n_devices < 0 || n_devices > MAX_DEVICES || 4 + n_devices >= argc)
        view_failed("devices", "", EINVAL);
    char **devices = argv + 4;
    long n_links = number(argv[4 + n_devices], "links");
    char **links = argv + 5 + n_devices;
    if (n_links < 0 || 5 + n_devices + 2 * n_links > argc)
        view_failed("links", "", EINVAL);
    char **steps = links + 2 * n_links;
    long n_steps = (argc - (steps - argv)) / 3;
    if ((argc - (steps - argv)) % 3 || n_steps > MAX_STEPS)
        view_failed("steps", "", EINVAL);
    static long clones[MAX_STEPS];
    long device_clones[MAX_DEVICES];
    char path[PATH_BYTES], sub[PATH_BYTES];

    CALL1(__NR_umask, 022);
    /* Clones first, in the host's tree: the binds, the devices, /dev/null for hidden files. */
    for (long i = 0; i < n_steps; i++) {
        const char *kind = steps[3 * i], *where = steps[3 * i + 1], *extra = steps[3 * i + 2];
        clones[i] = -1;
        if (same(kind, "ro") || same(kind, "rw"))
            clones[i] = clone_of(*extra ? extra : where);
        else if (same(kind, "hide") && !is_dir(where))
            clones[i] = clone_of("/dev/null");
        if (clones[i] >= 0)
            set_attr(clones[i], AT_RECURSIVE, 0, MS_PRIVATE, where);
    }
    for (long d = 0; d < n_devices; d++) {
        device_clones[d] = -1;
        if (mode_of(AT_FDCWD, joined(path, "/dev/", devices[d]), 0) >= 0) {
            device_clones[d] = clone_of(path);
            set_attr(device_clones[d], AT_RECURSIVE, 0, MS_PRIVATE, path);
        }
    }
    checked(CALL2(__NR_setns, BASE_FD, CLONE_NEWNS), "setns", "the base mount namespace");
    checked(CALL1(__NR_unshare, CLONE_NEWNS | CLONE_NEWIPC), "unshare", "mount and IPC namespaces");
    mount_fs(0, "/", 0, MS_REC | MS_PRIVATE, 0); /* nothing of ours may reach the host */
    /* A hidden directory that holds no other step shows a clone of the base's root, "/" until the view's
     * root goes on top of it (fsview.apply): empty, read-only, one filesystem for every view. */
    for (long i = 0; i < n_steps; i++) {
        if (same(steps[3 * i], "hide") && clones[i] < 0 && !holds_a_step(steps, n_steps, i)) {
            clones[i] = clone_of("/");
            set_attr(clones[i], 0, MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV | MOUNT_ATTR_NOEXEC,
                     MS_PRIVATE, "the base's root");
        }
    }
    long root = new_tmpfs("0755", "1m", MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV);
    move_to(root, "/"); /* on top of the host's root; built below through relative paths */
    checked(CALL1(__NR_fchdir, root), "fchdir", "the view's root");
    long read_only[MAX_STEPS + 2];
    int n_read_only = 0;
    read_only[n_read_only++] = root;
    for (long i = 0; i < n_steps; i++) {
        const char *kind = steps[3 * i], *extra = steps[3 * i + 2];
        joined(path, ".", steps[3 * i + 1]);
        if (same(kind, "link")) {
            make_parents(path);
            checked(CALL3(__NR_symlinkat, extra, AT_FDCWD, path), "symlink", path);
        } else if (same(kind, "proc")) {
            make_mount_point(path, 1);
            move_to(PROC_FD, path);
        } else if (same(kind, "dev")) {
            make_mount_point(path, 1);
            mount_fs("tmpfs", path, "tmpfs", MS_NOSUID | MS_NOEXEC, "mode=0755,size=64k");
            for (long d = 0; d < n_devices; d++) {
                if (device_clones[d] < 0)
                    continue;
                joined(sub, path, "/");
                joined(sub, sub, devices[d]);
                make_mount_point(sub, 0);
                set_attr(device_clones[d], 0, MOUNT_ATTR_NOSUID | MOUNT_ATTR_NOEXEC, 0, sub);
                move_to(device_clones[d], sub);
                CALL1(__NR_close, device_clones[d]);
            }
            for (long l = 0; l < n_links; l++) {
                joined(sub, path, "/");
                joined(sub, sub, links[2 * l]);
                checked(CALL3(__NR_symlinkat, links[2 * l + 1], AT_FDCWD, sub), "symlink", sub);
            }
            checked(CALL3(__NR_mkdirat, AT_FDCWD, joined(sub, path, "/pts"), 0755), "mkdir", sub);
            checked(CALL3(__NR_mkdirat, AT_FDCWD, joined(sub, path, "/shm"), 01777), "mkdir", sub);
            mount_fs("devpts", joined(sub, path, "/pts"), "devpts", MS_NOSUID | MS_NOEXEC,
                     "newinstance,ptmxmode=0666,mode=0620");
            read_only[n_read_only++] = handle_of(path);
        } else if (same(kind, "scratch") || (same(kind, "hide") && clones[i] < 0)) {
            int scratch = same(kind, "scratch");
            if (scratch)
                make_mount_point(path, 1);
            else if (!is_dir(path)) /* hidden already by a step above it */
                continue;
            char options[64];
            int at = 0;
            append(options, &at, scratch ? "mode=1777,size=" : "mode=0755,size=1m", 32);
            if (scratch)
                append(options, &at, scratch_size, 16);
            options[at] = 0;
            mount_fs("tmpfs", path, "tmpfs", MS_NOSUID | MS_NODEV, options);
            if (!scratch) /* read-only once the binds' mount points are made in it */
                read_only[n_read_only++] = handle_of(path);
        } else if (clones[i] >= 0) {
            long mode = mode_of((int)clones[i], "", AT_EMPTY_PATH);
            if (same(kind, "hide") && dir_mode(mode) && !is_dir(path)) {
                CALL1(__NR_close, clones[i]); /* hidden already by a step above it */
                continue;
            }
            unsigned long attrs = MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV;
            if (!same(kind, "rw"))
                attrs |= MOUNT_ATTR_RDONLY;
            set_attr(clones[i], AT_RECURSIVE, attrs, 0, path);
            make_mount_point(path, dir_mode(mode));
            move_to(clones[i], path);
            CALL1(__NR_close, clones[i]);
        } else {
            view_failed("step", kind, EINVAL);
        }
    }
    for (int i = 0; i < n_read_only; i++) {
        set_attr(read_only[i], 0, MOUNT_ATTR_RDONLY, 0, "the view");
        CALL1(__NR_close, read_only[i]);
    }
    checked(CALL1(__NR_chroot, "."), "chroot", ".");
    checked(CALL1(__NR_chdir, "/"), "chdir", "/");
    CALL3(__NR_write, 1, "1", 1);
    char byte;
    CALL3(__NR_read, 0, &byte, 1); /* until the server has opened our namespaces (or died) */
    return 0;
}

/* ---- a command ----------------------------------------------------------------------------------- */

static int run_command(int argc, char **argv) {
    if (argc < FIXED_ARGS + 3)
        fail("arguments", EINVAL);
    long nofile = number(argv[1], "descriptor limit");
    long as = number(argv[2], "address-space limit");
    long fsize = number(argv[3], "file-size limit");
    long oom = number(argv[4], "OOM score");
    long uid = number(argv[5], "uid");
    long gid = number(argv[6], "gid");
    const char *filter = argv[7];
    const char *cwd = argv[8];
    long n = number(argv[9], "candidates");
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

static int run(int argc, char **argv) {
    if (argc > 1 && same(argv[1], "view"))
        return build_view(argc, argv);
    return run_command(argc, argv);
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
