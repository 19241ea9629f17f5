/*
 * greyhound SPANK plugin: shared declarations.
 *
 * Two configuration channels, kept apart (as in pyxis):
 *   struct gh_config   the admin's plugstack.conf arguments (cluster-wide defaults)
 *   struct gh_options  the user's --greyhound=OPTIONS, or GREYHOUND_OPTIONS when
 *                      the flag is not given
 */
#ifndef GREYHOUND_H
#define GREYHOUND_H

#include <limits.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>
#include <time.h>

#include <slurm/spank.h>

#define GH_OPTION_MAX_LEN 1024 /* longest --greyhound= value accepted */
#define GH_MODE_MAX_LEN 16
#define GH_HOOK_LIB "libgreyhound_hook.so"
#define GH_LIBDIR "lib/greyhound" /* relative to prefix= */
#define GH_RETAIN_DAYS_DEFAULT 7 /* retain=: days a run directory stays after its job */
#define GH_RETAIN_DAYS_MAX 3650
#define GH_ERR_LEN 512 /* one message line */
/* Set in the environment of the control plane's own processes: never recorded. */
#define GH_CONTROL_PLANE_ENV "GREYHOUND_CONTROL_PLANE"

struct gh_config {
	int default_on;                /* 1: every job unless --greyhound=off */
	char mode[GH_MODE_MAX_LEN];    /* detect | mitigate */
	char prefix[PATH_MAX];         /* where greyhound is installed */
	char rundir[PATH_MAX];         /* parent of the per-job run directories */
	char python[PATH_MAX];         /* interpreter of the control plane; "" = none */
	int retain_days;               /* a run directory is removed this long after its job */
	int requeue;                   /* 1: S4 (checkpoint, requeue without the slow node) allowed */
	int broken;                    /* the arguments did not parse: greyhound is off */
};

struct gh_options {
	int seen;                      /* --greyhound given at all */
	int enabled;                   /* -1 unset, 0 off, 1 on */
	char mode[GH_MODE_MAX_LEN];    /* "" = the admin's default */
	int trace;                     /* -1 unset, 0 off, 1 on */
	char report[PATH_MAX];         /* "" = default report directory */
	int requeue;                   /* -1 unset, 0 off, 1 on (cannot override the admin's off) */
};

/* The effective state of this process, filled by the option callback and init. */
extern struct gh_config gh_config;
extern struct gh_options gh_options;

/* config.c */
void gh_config_defaults(struct gh_config *config);
int gh_config_parse(struct gh_config *config, int ac, char **av, char *err, size_t err_len);
void gh_options_defaults(struct gh_options *options);
int gh_options_parse(struct gh_options *options, const char *value, char *err, size_t err_len);
int gh_enabled(const struct gh_config *config, const struct gh_options *options);
const char *gh_effective_mode(const struct gh_config *config, const struct gh_options *options);
int gh_effective_requeue(const struct gh_config *config, const struct gh_options *options);

/* args.c */
int gh_register_options(spank_t sp);
int gh_options_from_env(spank_t sp);
int gh_local_init_post_opt(void);

/* pathlist.c */
int gh_path_prepend(char *out, size_t out_len, const char *entry, const char *current, const char *separators);
const char *gh_path_unprepend(const char *entry, const char *current);

/* rundir.c: the run directories, by file descriptor (see the file's comment) */
int gh_rundir_open(const char *rundir, int create, char *err, size_t err_len);
int gh_rundir_lock(int rundir_fd, char *err, size_t err_len);
void gh_rundir_unlock(int lock_fd);
int gh_job_dir_prepare(int rundir_fd, uint32_t job_id, uid_t uid, gid_t gid, time_t now, char *err,
		       size_t err_len);
int gh_job_dir_end(int rundir_fd, uint32_t job_id, char *err, size_t err_len);
int gh_rundir_sweep(int rundir_fd, int retain_days, time_t now, char *err, size_t err_len);
int gh_job_file_write(int dir_fd, const char *name, const char *content, uid_t uid, gid_t gid, char *err,
		      size_t err_len);
int gh_remove_tree_at(int parent_fd, const char *name);

/* remote.c */
int gh_remote_init_post_opt(spank_t sp);
int gh_remote_task_init(spank_t sp);

/* controlplane.c */
int gh_control_plane_start(const char *python, char *const *job_env, const char *hook, const char *capture,
			   pid_t *pid_out, char *err, size_t err_len);

/* jobscript.c */
int gh_job_epilog(spank_t sp, int ac, char **av);

#endif /* GREYHOUND_H */
