package cli

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os"
	"sync"
	"time"

	"github.com/spf13/cobra"
)

// healthFlags are the liveness options of the long-running commands
// (dispatch, consume): an HTTP endpoint for ECS and Kubernetes probes, a
// file for probes that can only run a command.
type healthFlags struct {
	addr     string
	file     string
	interval time.Duration
}

func (h *healthFlags) register(c *cobra.Command) {
	f := c.Flags()
	f.StringVar(&h.addr, "health-addr", os.Getenv("FIFOBOX_HEALTH_ADDR"),
		"serve GET /healthz here (e.g. :8080): 200 while healthy, 503 and why otherwise (env FIFOBOX_HEALTH_ADDR)")
	f.StringVar(&h.file, "liveness-file", os.Getenv("FIFOBOX_LIVENESS_FILE"),
		"touch this file after every successful health check and remove it on exit (env FIFOBOX_LIVENESS_FILE)")
	f.DurationVar(&h.interval, "health-interval", 10*time.Second, "how often the health check runs")
}

// health is the state a long-running process reports: healthy while its
// loop runs and its check (the database answers) passes.
type health struct {
	mu      sync.Mutex
	err     error
	checked time.Time
	file    string
}

func (h *health) set(err error) {
	h.mu.Lock()
	h.err, h.checked = err, time.Now()
	h.mu.Unlock()
	if h.file == "" {
		return
	}
	if err == nil {
		_ = os.WriteFile(h.file, []byte(time.Now().UTC().Format(time.RFC3339)+"\n"), 0o644)
	}
}

func (h *health) ServeHTTP(w http.ResponseWriter, _ *http.Request) {
	h.mu.Lock()
	err, checked := h.err, h.checked
	h.mu.Unlock()
	w.Header().Set("Content-Type", "text/plain; charset=utf-8")
	switch {
	case checked.IsZero():
		w.WriteHeader(http.StatusServiceUnavailable)
		fmt.Fprintln(w, "starting")
	case err != nil:
		w.WriteHeader(http.StatusServiceUnavailable)
		fmt.Fprintf(w, "unhealthy: %v\n", err)
	default:
		fmt.Fprintf(w, "ok (checked %s ago)\n", time.Since(checked).Round(time.Second))
	}
}

// startHealth runs check every interval until ctx ends and serves the
// result; the returned stop shuts the endpoint down and removes the file.
func (hf healthFlags) start(ctx context.Context, log *slog.Logger, check func(context.Context) error) (func(), error) {
	h := &health{file: hf.file}
	if hf.interval <= 0 {
		return nil, errors.New("--health-interval: must be positive")
	}
	var srv *http.Server
	if hf.addr != "" {
		ln, err := net.Listen("tcp", hf.addr)
		if err != nil {
			return nil, fmt.Errorf("--health-addr %s: %w", hf.addr, err)
		}
		mux := http.NewServeMux()
		mux.Handle("GET /healthz", h)
		srv = &http.Server{Handler: mux, ReadHeaderTimeout: 5 * time.Second}
		go func() { _ = srv.Serve(ln) }()
		log.Info("health endpoint", "addr", ln.Addr().String())
	}
	cctx, cancel := context.WithCancel(ctx)
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		t := time.NewTicker(hf.interval)
		defer t.Stop()
		for {
			c, done := context.WithTimeout(cctx, 5*time.Second)
			err := check(c)
			done()
			if cctx.Err() != nil {
				return
			}
			if err != nil {
				log.Warn("health check failed", "error", err.Error())
			}
			h.set(err)
			select {
			case <-cctx.Done():
				return
			case <-t.C:
			}
		}
	}()
	return func() {
		cancel()
		wg.Wait()
		h.set(errors.New("stopping"))
		if srv != nil {
			sctx, c := context.WithTimeout(context.Background(), 2*time.Second)
			_ = srv.Shutdown(sctx)
			c()
		}
		if hf.file != "" {
			_ = os.Remove(hf.file)
		}
	}, nil
}
