/*
 * pullgen: a closed-loop pull load generator for bench/fairness.py.
 *
 * N keep-alive HTTP/1.1 connections to the broker, one consumer each, every one sending
 * POST /v1/pull (wait_ms 0) again as soon as the previous answer is in. Counts messages by
 * their "seq" keys without parsing the JSON, so it costs a small fraction of the broker's
 * CPU per pull and the broker, not the generator, sets the pace. Only pulls that complete
 * inside [begin, end) (epoch seconds) are counted; CPU time is measured over that window.
 *
 *   pullgen PORT SUBJECT GROUP CONSUMERS MAX BEGIN END
 *
 * Prints one JSON object: delivered, pulls, errors, cpu_share, p50_ms, p99_ms, and the
 * latencies (ms) of every counted pull.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

typedef struct {
    int fd;
    char *request;
    size_t request_len, sent;
    char *buf;
    size_t cap, len;
    double started;
} conn_t;

static double now_epoch(void) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return ts.tv_sec + ts.tv_nsec / 1e9;
}

static double cpu_seconds(void) {
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    return ru.ru_utime.tv_sec + ru.ru_utime.tv_usec / 1e6 + ru.ru_stime.tv_sec +
           ru.ru_stime.tv_usec / 1e6;
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static size_t count_seqs(const char *body, size_t len) {
    size_t n = 0;
    const char *p = body, *end = body + len;
    while ((p = memmem(p, end - p, "\"seq\":", 6)) != NULL) {
        n++;
        p += 6;
    }
    return n;
}

/* Complete response in c->buf? Returns its total length (0: not yet), sets status/body. */
static size_t response_ready(conn_t *c, int *status, char **body, size_t *body_len) {
    char *head_end = memmem(c->buf, c->len, "\r\n\r\n", 4);
    if (!head_end) return 0;
    size_t head_len = head_end - c->buf + 4;
    *status = atoi(c->buf + 9);
    size_t content_length = 0;
    for (char *line = c->buf; line < head_end;) {
        char *eol = memmem(line, head_end - line + 2, "\r\n", 2);
        if (!eol) break;
        if (eol - line > 15 && strncasecmp(line, "content-length:", 15) == 0)
            content_length = strtoul(line + 15, NULL, 10);
        line = eol + 2;
    }
    if (c->len < head_len + content_length) return 0;
    *body = c->buf + head_len;
    *body_len = content_length;
    return head_len + content_length;
}

int main(int argc, char **argv) {
    if (argc != 8) {
        fprintf(stderr, "usage: pullgen PORT SUBJECT GROUP CONSUMERS MAX BEGIN END\n");
        return 2;
    }
    int port = atoi(argv[1]);
    const char *subject = argv[2], *group = argv[3];
    int consumers = atoi(argv[4]), max = atoi(argv[5]);
    double begin = atof(argv[6]), end = atof(argv[7]);

    int ep = epoll_create1(0);
    conn_t *conns = calloc(consumers, sizeof(conn_t));
    size_t lat_cap = 1 << 20, lat_n = 0;
    double *lat = malloc(lat_cap * sizeof(double));
    long delivered = 0, pulls = 0, errors = 0;
    double cpu_begin = -1, cpu_end = -1;

    for (int i = 0; i < consumers; i++) {
        conn_t *c = &conns[i];
        char body[512];
        int body_len = snprintf(body, sizeof body,
                                "{\"subject\":\"%s\",\"group\":\"%s\",\"consumer\":\"%s-%d\","
                                "\"max\":%d,\"wait_ms\":0}",
                                subject, group, group, i, max);
        c->request = malloc(1024);
        c->request_len = snprintf(c->request, 1024,
                                  "POST /v1/pull HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                                  "Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s",
                                  body_len, body);
        c->cap = 1 << 16;
        c->buf = malloc(c->cap);
        c->fd = socket(AF_INET, SOCK_STREAM, 0);
        int one = 1;
        setsockopt(c->fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
        struct sockaddr_in addr = {.sin_family = AF_INET, .sin_port = htons(port)};
        addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
        if (connect(c->fd, (struct sockaddr *)&addr, sizeof addr) != 0) {
            perror("connect");
            return 1;
        }
        struct epoll_event ev = {.events = EPOLLIN, .data.u32 = i};
        epoll_ctl(ep, EPOLL_CTL_ADD, c->fd, &ev);
    }
    for (int i = 0; i < consumers; i++) {
        conns[i].started = now_epoch();
        if (write(conns[i].fd, conns[i].request, conns[i].request_len) < 0) return 1;
    }
    struct epoll_event events[256];
    while (1) {
        double t = now_epoch();
        if (cpu_begin < 0 && t >= begin) cpu_begin = cpu_seconds();
        if (t >= end) break;
        int n = epoll_wait(ep, events, 256, 10);
        for (int k = 0; k < n; k++) {
            conn_t *c = &conns[events[k].data.u32];
            if (c->cap - c->len < 65536) {
                c->cap *= 2;
                c->buf = realloc(c->buf, c->cap);
            }
            ssize_t got = read(c->fd, c->buf + c->len, c->cap - c->len);
            if (got <= 0) {
                if (got < 0 && errno == EINTR) continue;
                fprintf(stderr, "connection closed\n");
                return 1;
            }
            c->len += got;
            int status;
            char *body;
            size_t body_len, total;
            while ((total = response_ready(c, &status, &body, &body_len)) > 0) {
                double done = now_epoch();
                if (done >= begin && done < end) {
                    if (status == 200) {
                        delivered += count_seqs(body, body_len);
                        pulls++;
                        if (lat_n < lat_cap) lat[lat_n++] = (done - c->started) * 1000;
                    } else {
                        errors++;
                    }
                }
                memmove(c->buf, c->buf + total, c->len - total);
                c->len -= total;
                c->started = now_epoch();
                if (write(c->fd, c->request, c->request_len) < 0) return 1;
            }
        }
    }
    cpu_end = cpu_seconds();
    qsort(lat, lat_n, sizeof(double), cmp_double);
    double p50 = lat_n ? lat[(size_t)(0.50 * lat_n)] : -1;
    double p99 = lat_n ? lat[(size_t)(0.99 * lat_n)] : -1;
    printf("{\"group\": \"%s\", \"consumers\": %d, \"delivered\": %ld, \"pulls\": %ld, "
           "\"errors\": %ld, \"cpu_share\": %.4f, \"p50_ms\": %.4f, \"p99_ms\": %.4f, "
           "\"latencies\": [",
           group, consumers, delivered, pulls, errors,
           (cpu_end - (cpu_begin < 0 ? cpu_end : cpu_begin)) / (end - begin), p50, p99);
    for (size_t i = 0; i < lat_n; i++) printf(i ? ",%.7f" : "%.7f", lat[i] / 1000.0);
    printf("]}\n");
    return 0;
}
