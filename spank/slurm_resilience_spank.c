/*
 * slurm-resilience SPANK plugin: job options for sbatch/salloc/srun.
 *
 *   --ckpt-uri=s3://bucket/user/run   where checkpoints of this run live (its identity)
 *   --hang-timeout=SECONDS            stall timeout of the hang watcher for this job
 *   --hang-watch=on|observe|off       hang handling for this job: act, report only, or none
 *   --leaf-pin=on|off                 opt out of keeping the job under one IB leaf
 *   --nccl-test                       ask the prolog for an NCCL loopback test
 *
 * Each option is validated where the user typed it (a bad value fails sbatch with
 * a message naming the option). Values reach:
 *   - the prolog/epilog and job_submit as SPANK_SLURM_RESILIENCE_<NAME>
 *     (spank_job_control_setenv). A user's own SLURM_CONF/plugstack can set these
 *     too, so root checks them again in Python (hooks/context.py) before use;
 *   - the job's tasks as SLURM_RESILIENCE_<NAME> (spank_setenv, remote context),
 *     where the training-side API reads them.
 *
 * plugstack.conf arguments are strict key=value; unknown keys fail plugin load:
 *   max_hang_timeout=SECONDS   (default 86400)
 */
#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <slurm/spank.h>

SPANK_PLUGIN(slurm_resilience, 1);

#define ENV_PREFIX "SLURM_RESILIENCE_"
#define MAX_VALUE 1024

static long max_hang_timeout = 86400;

enum opt_id { OPT_CKPT_URI = 1, OPT_HANG_TIMEOUT, OPT_HANG_WATCH, OPT_LEAF_PIN, OPT_NCCL_TEST };

static int on_option(int val, const char *optarg, int remote);

static struct spank_option options[] = {
    {"ckpt-uri", "URI", "slurm-resilience: checkpoint location of this run (s3://bucket/prefix)",
     1, OPT_CKPT_URI, on_option},
    {"hang-timeout", "SECONDS", "slurm-resilience: requeue the job when a rank makes no "
     "progress for this long", 1, OPT_HANG_TIMEOUT, on_option},
    {"hang-watch", "on|observe|off", "slurm-resilience: hang detection and automatic requeue; "
     "observe only reports (default on)", 1, OPT_HANG_WATCH, on_option},
    {"leaf-pin", "on|off", "slurm-resilience: keep a multi-node job under one InfiniBand "
     "leaf switch (default on)", 1, OPT_LEAF_PIN, on_option},
    {"nccl-test", NULL, "slurm-resilience: run the NCCL loopback test in the prolog",
     0, OPT_NCCL_TEST, on_option},
    SPANK_OPTIONS_TABLE_END
};

/* Values accepted in the current process, applied in init_post_opt. */
static char values[OPT_NCCL_TEST + 1][MAX_VALUE];

static const char *env_name(int id)
{
    switch (id) {
    case OPT_CKPT_URI: return "CKPT_URI";
    case OPT_HANG_TIMEOUT: return "HANG_TIMEOUT";
    case OPT_HANG_WATCH: return "HANG";  /* read by slurm_resilience.heartbeat */
    case OPT_LEAF_PIN: return "LEAF_PIN";
    case OPT_NCCL_TEST: return "NCCL_TEST";
    }
    return NULL;
}

static int printable(const char *s)
{
    for (; *s; s++)
        if ((unsigned char)*s < 0x21 || (unsigned char)*s > 0x7e)
            return 0;
    return 1;
}

static int check_value(int id, const char *arg, char *out, size_t outlen)
{
    char *end = NULL;
    long n;

    if (id == OPT_NCCL_TEST) {
        snprintf(out, outlen, "1");
        return 0;
    }
    if (arg == NULL || *arg == '\0' || strlen(arg) >= outlen || !printable(arg)) {
        slurm_error("slurm-resilience: --%s: value must be 1-%zu printable characters without "
                    "spaces", options[id - 1].name, outlen - 1);
        return -1;
    }
    switch (id) {
    case OPT_CKPT_URI:
        if (strncmp(arg, "s3://", 5) != 0 || arg[5] == '\0' || arg[5] == '/' ||
            strstr(arg, "..") != NULL) {
            slurm_error("slurm-resilience: --ckpt-uri=%s: expected s3://bucket/prefix "
                        "without '..'", arg);
            return -1;
        }
        break;
    case OPT_HANG_TIMEOUT:
        errno = 0;
        n = strtol(arg, &end, 10);
        if (errno || *end != '\0' || n < 10 || n > max_hang_timeout) {
            slurm_error("slurm-resilience: --hang-timeout=%s: expected whole seconds in "
                        "[10, %ld]", arg, max_hang_timeout);
            return -1;
        }
        break;
    case OPT_HANG_WATCH:
        if (strcmp(arg, "on") != 0 && strcmp(arg, "observe") != 0 && strcmp(arg, "off") != 0) {
            slurm_error("slurm-resilience: --hang-watch=%s: expected on, observe or off", arg);
            return -1;
        }
        break;
    case OPT_LEAF_PIN:
        if (strcmp(arg, "on") != 0 && strcmp(arg, "off") != 0) {
            slurm_error("slurm-resilience: --%s=%s: expected on or off",
                        options[id - 1].name, arg);
            return -1;
        }
        break;
    default:
        return -1;
    }
    snprintf(out, outlen, "%s", arg);
    return 0;
}

static int on_option(int val, const char *optarg, int remote)
{
    (void)remote;
    if (val < OPT_CKPT_URI || val > OPT_NCCL_TEST)
        return -1;
    return check_value(val, optarg, values[val], sizeof(values[val]));
}

static int parse_args(int ac, char **av)
{
    for (int i = 0; i < ac; i++) {
        if (strncmp(av[i], "max_hang_timeout=", 17) == 0) {
            char *end = NULL;
            errno = 0;
            long n = strtol(av[i] + 17, &end, 10);
            if (errno || *end != '\0' || n < 10) {
                slurm_error("slurm-resilience: plugstack: %s: expected seconds >= 10", av[i]);
                return -1;
            }
            max_hang_timeout = n;
        } else {
            slurm_error("slurm-resilience: plugstack: unknown argument '%s'; valid keys: "
                        "max_hang_timeout", av[i]);
            return -1;
        }
    }
    return 0;
}

int slurm_spank_init(spank_t sp, int ac, char **av)
{
    if (parse_args(ac, av) != 0)
        return -1;
    for (struct spank_option *o = options; o->name != NULL; o++) {
        if (spank_option_register(sp, o) != ESPANK_SUCCESS) {
            slurm_error("slurm-resilience: couldn't register option --%s", o->name);
            return -1;
        }
    }
    return 0;
}

int slurm_spank_init_post_opt(spank_t sp, int ac, char **av)
{
    char name[64];
    spank_context_t ctx = spank_context();

    (void)ac;
    (void)av;
    for (int id = OPT_CKPT_URI; id <= OPT_NCCL_TEST; id++) {
        if (values[id][0] == '\0')
            continue;
        snprintf(name, sizeof(name), ENV_PREFIX "%s", env_name(id));
        if (ctx == S_CTX_ALLOCATOR || ctx == S_CTX_LOCAL) {
            /* Seen by prolog/epilog (as SPANK_<name>) and by job_submit. */
            if (spank_job_control_setenv(sp, name, values[id], 1) != ESPANK_SUCCESS) {
                slurm_error("slurm-resilience: couldn't pass %s to the job", name);
                return -1;
            }
        } else if (ctx == S_CTX_REMOTE) {
            /* Seen by the job's tasks, where the training API reads it. */
            if (spank_setenv(sp, name, values[id], 1) != ESPANK_SUCCESS) {
                slurm_error("slurm-resilience: couldn't set %s for the tasks", name);
                return -1;
            }
        }
    }
    return 0;
}
