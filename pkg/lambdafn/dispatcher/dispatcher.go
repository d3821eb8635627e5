// Package dispatcher is the dispatcher Lambda's handler: each invocation
// (an EventBridge Scheduler tick, once a minute) runs outbox.Dispatcher.Run
// until shortly before the invocation's deadline, so events committed during
// the invocation are published within a poll interval, and emits EMF metrics
// every MetricsInterval while it runs (and at its start and end): the outbox
// backlog gauges (due, backing off, parked, retrying, publish lag) and batch
// counts.
//
// Overlapping invocations are safe: the claim leases aggregate heads FOR
// UPDATE SKIP LOCKED, so two dispatchers never publish an aggregate at once
// and per-aggregate order holds.
package dispatcher

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"strconv"
	"sync"
	"time"

	"github.com/fifobox/fifobox/pkg/envspec"
	"github.com/fifobox/fifobox/pkg/metrics"
	"github.com/fifobox/fifobox/pkg/outbox"
)

// Config configures the handler.
type Config struct {
	// Dispatcher tunes the outbox dispatcher (batch size, deadline margin...).
	Dispatcher outbox.DispatcherConfig
	// MetricsInterval is how often the backlog gauges and batch counts are
	// emitted as EMF lines while the invocation runs. Default 10s.
	MetricsInterval time.Duration
	// NoDeadlineRun bounds an invocation whose context has no deadline (a
	// local run): Run then stops after this long. Default 50s.
	NoDeadlineRun time.Duration
	// Logger; default slog.Default().
	Logger *slog.Logger
}

func (c *Config) setDefaults() {
	if c.MetricsInterval == 0 {
		c.MetricsInterval = 10 * time.Second
	}
	if c.NoDeadlineRun == 0 {
		c.NoDeadlineRun = 50 * time.Second
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	if c.Dispatcher.Logger == nil {
		c.Dispatcher.Logger = c.Logger
	}
}

// Validate reports the first invalid field.
func (c Config) Validate() error {
	switch {
	case c.MetricsInterval < 0:
		return fmt.Errorf("MetricsInterval %s: must not be negative", c.MetricsInterval)
	case c.NoDeadlineRun < 0:
		return fmt.Errorf("NoDeadlineRun %s: must not be negative", c.NoDeadlineRun)
	case c.Dispatcher.OnBatch != nil:
		return errors.New("Dispatcher.OnBatch: set by the handler, leave it nil")
	}
	return nil
}

// Env is every variable ConfigFromEnv reads (declare a new one here; the
// runtime contract tests check the CDK template against this list). Where
// the dispatcher publishes (FIFOBOX_TRANSPORT and that transport's
// settings) is transport.RegisteredEnv's.
var Env = envspec.Set{
	{Name: "FIFOBOX_BATCH_SIZE", Doc: "most events one claim takes (positive integer, default 500)"},
	{Name: "FIFOBOX_MAX_RUN", Doc: "most consecutive events of one aggregate per claim while other aggregates compete (positive integer, default a quarter of the batch; extended when the batch has room)"},
	{Name: "FIFOBOX_RUN_BUDGET", Doc: "time one aggregate's run may take to publish (Go duration, default 100ms)"},
	{Name: "FIFOBOX_PUBLISH_CONCURRENCY", Doc: "concurrent PublishBatch calls (positive integer)"},
	{Name: "FIFOBOX_MAX_ATTEMPTS", Doc: "optional cap on publish attempts per event (0 or unset: none; RetryFor decides)"},
	{Name: "FIFOBOX_RETRY_FOR", Doc: "how long retryable publish failures are retried before the event goes dead (Go duration, default 24h)"},
	{Name: "FIFOBOX_POLL_INTERVAL", Doc: "pause between claims when nothing is due (Go duration)"},
	{Name: "FIFOBOX_DEADLINE_MARGIN", Doc: "time kept free before the invocation's deadline (Go duration)"},
	{Name: "FIFOBOX_METRICS_INTERVAL", Doc: "how often gauges and counts are emitted while running (Go duration, default 10s)"},
	{Name: "FIFOBOX_LOG_AGGREGATE_IDS", Doc: "log aggregate ids (true/false, default false: they may carry personal data)"},
}

// ConfigFromEnv reads the optional knobs: FIFOBOX_BATCH_SIZE,
// FIFOBOX_MAX_RUN, FIFOBOX_PUBLISH_CONCURRENCY, FIFOBOX_MAX_ATTEMPTS (0: no
// cap), FIFOBOX_RETRY_FOR, FIFOBOX_RUN_BUDGET, FIFOBOX_POLL_INTERVAL,
// FIFOBOX_DEADLINE_MARGIN and FIFOBOX_METRICS_INTERVAL (durations such as
// "50ms", "3s", "24h"), FIFOBOX_LOG_AGGREGATE_IDS (true/false). Unset ones
// keep their defaults; a bad value is an error naming the variable.
func ConfigFromEnv() (Config, error) {
	var c Config
	ints := []struct {
		name string
		dst  *int
	}{
		{"FIFOBOX_BATCH_SIZE", &c.Dispatcher.BatchSize},
		{"FIFOBOX_MAX_RUN", &c.Dispatcher.MaxRun},
		{"FIFOBOX_PUBLISH_CONCURRENCY", &c.Dispatcher.PublishConcurrency},
		{"FIFOBOX_MAX_ATTEMPTS", &c.Dispatcher.MaxAttempts},
	}
	for _, v := range ints {
		if s := Env.Get(v.name); s != "" {
			n, err := strconv.Atoi(s)
			if err != nil || n < 0 || (n == 0 && v.name != "FIFOBOX_MAX_ATTEMPTS") {
				return c, fmt.Errorf("%s=%q: want a positive integer", v.name, s)
			}
			*v.dst = n
		}
	}
	durs := []struct {
		name string
		dst  *time.Duration
	}{
		{"FIFOBOX_POLL_INTERVAL", &c.Dispatcher.PollInterval},
		{"FIFOBOX_DEADLINE_MARGIN", &c.Dispatcher.DeadlineMargin},
		{"FIFOBOX_RETRY_FOR", &c.Dispatcher.RetryFor},
		{"FIFOBOX_RUN_BUDGET", &c.Dispatcher.RunBudget},
		{"FIFOBOX_METRICS_INTERVAL", &c.MetricsInterval},
	}
	for _, v := range durs {
		if s := Env.Get(v.name); s != "" {
			d, err := time.ParseDuration(s)
			if err != nil || d <= 0 {
				return c, fmt.Errorf("%s=%q: want a positive duration such as 500ms or 3s", v.name, s)
			}
			*v.dst = d
		}
	}
	if s := Env.Get("FIFOBOX_LOG_AGGREGATE_IDS"); s != "" {
		b, err := strconv.ParseBool(s)
		if err != nil {
			return c, fmt.Errorf("FIFOBOX_LOG_AGGREGATE_IDS=%q: want true or false", s)
		}
		c.Dispatcher.LogAggregateIDs = b
	}
	return c, nil
}

// Handler runs the dispatcher for one invocation at a time. Build it once at
// init and register Handle with lambda.Start.
type Handler struct {
	db  outbox.DB
	pub outbox.Publisher
	em  *metrics.Emitter
	cfg Config
	log *slog.Logger
}

// New returns a Handler. em may be nil (no metrics).
func New(db outbox.DB, pub outbox.Publisher, em *metrics.Emitter, cfg Config) (*Handler, error) {
	if db == nil || pub == nil {
		return nil, errors.New("new dispatcher handler: db and publisher are required")
	}
	cfg.setDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, fmt.Errorf("new dispatcher handler: %w", err)
	}
	// Check the dispatcher config once, at init, not on every invocation.
	if _, err := outbox.NewDispatcher(db, pub, cfg.Dispatcher); err != nil {
		return nil, fmt.Errorf("new dispatcher handler: %w", err)
	}
	return &Handler{db: db, pub: pub, em: em, cfg: cfg, log: cfg.Logger}, nil
}

// Result summarises one invocation (the Lambda's response, also logged).
type Result struct {
	Batches    int64         `json:"batches"`
	Published  int64         `json:"published"`
	Retries    int64         `json:"retries"`
	Dead       int64         `json:"dead"`
	Lost       int64         `json:"lost"`
	DurationMs int64         `json:"duration_ms"`
	Start      BacklogReport `json:"backlog_start"`
	End        BacklogReport `json:"backlog_end"`
}

// BacklogReport is outbox.Backlog in JSON-friendly units.
type BacklogReport struct {
	Pending             int64   `json:"pending"`
	Due                 int64   `json:"due"`
	BackingOff          int64   `json:"backing_off"`
	Parked              int64   `json:"parked"`
	RetryingAggregates  int64   `json:"retrying_aggregates"`
	InFlight            int64   `json:"in_flight"`
	Dead                int64   `json:"dead"`
	ParkedAggregates    int64   `json:"parked_aggregates"`
	OldestDueAgeSec     float64 `json:"oldest_due_age_seconds"`
	OldestPendingAgeSec float64 `json:"oldest_pending_age_seconds"`
	Stranded            int64   `json:"stranded"`
	// OldestTransactionAgeSec is the server's oldest transaction holding
	// back vacuum (outbox.Backlog.OldestTransactionAge).
	OldestTransactionAgeSec float64 `json:"oldest_transaction_age_seconds"`
}

func report(b outbox.Backlog) BacklogReport {
	return BacklogReport{Pending: b.Pending, Due: b.DueEvents, BackingOff: b.BackingOffEvents, Parked: b.ParkedEvents,
		RetryingAggregates: b.RetryingAggregates, InFlight: b.InFlight, Dead: b.Dead, ParkedAggregates: b.ParkedAggregates,
		OldestDueAgeSec: b.OldestDueAge.Seconds(), OldestPendingAgeSec: b.OldestPendingAge.Seconds(), Stranded: b.StrandedEvents,
		OldestTransactionAgeSec: b.OldestTransactionAge.Seconds()}
}

// Handle is the Lambda handler. The event (EventBridge Scheduler or any
// JSON) is ignored: every invocation does the same thing. It returns before
// ctx's deadline, with every claimed batch finished (published and marked).
func (h *Handler) Handle(ctx context.Context, _ json.RawMessage) (Result, error) {
	start := time.Now()
	if _, ok := ctx.Deadline(); !ok && h.cfg.NoDeadlineRun > 0 {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, h.cfg.NoDeadlineRun)
		defer cancel()
	}
	var res Result
	if b, err := h.stats(ctx); err != nil {
		h.log.Warn("outbox stats at start failed", "error", err.Error())
	} else {
		res.Start = report(b)
	}

	var (
		counter metrics.BatchCounter
		mu      sync.Mutex
	)
	cfg := h.cfg.Dispatcher
	cfg.OnBatch = func(r outbox.BatchResult) {
		counter.Add(r)
		mu.Lock()
		res.Batches++
		mu.Unlock()
	}
	d, err := outbox.NewDispatcher(h.db, h.pub, cfg)
	if err != nil {
		return res, err
	}
	stopFlush := make(chan struct{})
	flushed := make(chan struct{})
	go func() {
		defer close(flushed)
		if h.em == nil || h.cfg.MetricsInterval <= 0 {
			<-stopFlush
			return
		}
		t := time.NewTicker(h.cfg.MetricsInterval)
		defer t.Stop()
		for {
			select {
			case <-stopFlush:
				return
			case <-t.C:
				h.emit(counter.Flush(h.em))
				// The gauges too: alarms evaluate them every minute, and an
				// invocation runs for minutes.
				if _, err := h.stats(ctx); err != nil {
					h.log.Warn("outbox stats failed", "error", err.Error())
				}
			}
		}
	}()
	runErr := d.Run(ctx)
	close(stopFlush)
	<-flushed
	if h.em != nil {
		h.emit(counter.Flush(h.em))
	}

	tot := d.Totals()
	res.Published, res.Retries, res.Dead, res.Lost = tot.Sent, tot.Retried, tot.Dead, tot.Lost
	if b, err := h.stats(ctx); err != nil {
		h.log.Warn("outbox stats at end failed", "error", err.Error())
	} else {
		res.End = report(b)
	}
	res.DurationMs = time.Since(start).Milliseconds()
	h.log.Info("dispatcher invocation done", "batches", res.Batches, "published", res.Published, "retries", res.Retries,
		"dead", res.Dead, "lost", res.Lost, "pending", res.End.Pending, "due", res.End.Due, "backing_off", res.End.BackingOff,
		"parked", res.End.Parked, "dead_total", res.End.Dead, "oldest_due_age_seconds", res.End.OldestDueAgeSec,
		"stranded", res.End.Stranded, "oldest_transaction_age_seconds", res.End.OldestTransactionAgeSec,
		"duration_ms", res.DurationMs)
	return res, runErr
}

// stats reads the backlog and emits it, within a short timeout that never
// reaches past the invocation's deadline.
func (h *Handler) stats(ctx context.Context) (outbox.Backlog, error) {
	timeout := 5 * time.Second
	if dl, ok := ctx.Deadline(); ok {
		// Keep a little room to return the response.
		timeout = min(timeout, time.Until(dl)-100*time.Millisecond)
	}
	if timeout <= 0 {
		return outbox.Backlog{}, errors.New("no time left before the deadline")
	}
	sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), timeout)
	defer cancel()
	b, err := outbox.Stats(sctx, h.db)
	if err != nil {
		return b, err
	}
	if h.em != nil {
		h.emit(h.em.DispatcherBacklog(b))
	}
	return b, nil
}

func (h *Handler) emit(err error) {
	if err != nil {
		h.log.Warn("emit metrics failed", "error", err.Error())
	}
}
