// Package localdemo runs the whole fifobox pipeline on one machine: a demo
// producer writes orders and their events in one transaction each, the
// dispatcher publishes them to SNS FIFO on the local emulator, and readers
// on every subscribed SQS FIFO queue check that each aggregate's events
// arrive in order. It prints a live progress line and a summary.
package localdemo

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/service/sqs"
	sqstypes "github.com/aws/aws-sdk-go-v2/service/sqs/types"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/fifobox/fifobox/pkg/envelope"
	"github.com/fifobox/fifobox/pkg/outbox"
	"github.com/fifobox/fifobox/pkg/topology/provision"
)

// Config of a demo run.
type Config struct {
	// Orders to create; each makes three events (created, paid, shipped). Default 300.
	Orders int
	// Rate is the target number of business transactions per second. Default 200.
	Rate int
	// Out receives the progress line and summary.
	Out io.Writer
	// Interactive redraws the progress line in place (a terminal).
	Interactive bool
}

// Deps are the running pieces the demo drives.
type Deps struct {
	Pool       *pgxpool.Pool
	SQS        *sqs.Client
	Resources  provision.Resources
	Dispatcher *outbox.Dispatcher
	Log        *slog.Logger
}

// OrderPayload is the demo's order event payload.
type OrderPayload struct {
	OrderID     string `json:"order_id"`
	CustomerID  string `json:"customer_id"`
	AmountCents int64  `json:"amount_cents"`
	Currency    string `json:"currency"`
	Status      string `json:"status"`
}

const schema = `CREATE TABLE IF NOT EXISTS demo_orders (
    id text PRIMARY KEY, customer_id text NOT NULL, amount_cents bigint NOT NULL,
    status text NOT NULL, updated_at timestamptz NOT NULL DEFAULT now())`

type queueStats struct {
	received   atomic.Int64
	violations atomic.Int64
	repeats    atomic.Int64
	mu         sync.Mutex
	last       map[string]int64
	seen       map[string]bool
	lat        []time.Duration
}

// Run executes the demo until every event reached every queue that
// subscribes to it, or ctx is cancelled (Ctrl-C).
func Run(ctx context.Context, cfg Config, d Deps) error {
	if cfg.Orders <= 0 {
		cfg.Orders = 300
	}
	if cfg.Rate <= 0 {
		cfg.Rate = 200
	}
	if _, err := d.Pool.Exec(ctx, schema); err != nil {
		return fmt.Errorf("demo schema: %w", err)
	}
	runID := fmt.Sprintf("%x", rand.Uint32())

	// Readers, one per consumer queue.
	names := make([]string, 0, len(d.Resources.Queues))
	for n := range d.Resources.Queues {
		names = append(names, n)
	}
	sort.Strings(names)
	stats := map[string]*queueStats{}
	expected := map[string]*atomic.Int64{}
	rctx, stopReaders := context.WithCancel(context.Background())
	defer stopReaders()
	var rwg sync.WaitGroup
	for _, n := range names {
		st := &queueStats{last: map[string]int64{}, seen: map[string]bool{}}
		stats[n] = st
		expected[n] = &atomic.Int64{}
		q := d.Resources.Queues[n]
		rwg.Add(1)
		go func() { defer rwg.Done(); readQueue(rctx, d.SQS, q.URL, runID, st) }()
	}

	// Dispatcher loop.
	dctx, stopDispatcher := context.WithCancel(context.Background())
	defer stopDispatcher()
	var dwg sync.WaitGroup
	dwg.Add(1)
	go func() { defer dwg.Done(); _ = d.Dispatcher.Run(dctx) }()

	// Producer: orders advance created -> paid -> shipped, interleaved.
	var enqueued atomic.Int64
	prodDone := make(chan error, 1)
	start := time.Now()
	go func() { prodDone <- produce(ctx, cfg, d, runID, &enqueued, expected) }()

	tick := time.NewTicker(250 * time.Millisecond)
	defer tick.Stop()
	var prodErr error
	producing := true
	lastPrint := time.Time{}
loop:
	for {
		select {
		case <-ctx.Done():
			break loop
		case err := <-prodDone:
			producing = false
			prodErr = err
			if err != nil {
				break loop
			}
		case <-tick.C:
		}
		if cfg.Interactive || time.Since(lastPrint) > 2*time.Second {
			progress(ctx, cfg, d, names, stats, &enqueued, producing)
			lastPrint = time.Now()
		}
		if !producing && allArrived(names, stats, expected) {
			break
		}
	}
	elapsed := time.Since(start)
	progress(context.Background(), cfg, d, names, stats, &enqueued, false)
	fmt.Fprintln(cfg.Out)
	stopDispatcher()
	dwg.Wait()
	stopReaders()
	rwg.Wait()
	summary(cfg.Out, elapsed, names, stats, expected, &enqueued, d.Dispatcher.Totals())
	if prodErr != nil && !errors.Is(prodErr, context.Canceled) {
		return prodErr
	}
	for _, n := range names {
		if stats[n].violations.Load() > 0 {
			return fmt.Errorf("queue %s: %d order violations", n, stats[n].violations.Load())
		}
	}
	return nil
}

func produce(ctx context.Context, cfg Config, d Deps, runID string, enqueued *atomic.Int64, expected map[string]*atomic.Int64) error {
	steps := []string{"created", "paid", "shipped"}
	// Each order gets its three steps at random later points, so many orders
	// are in flight at once and their events interleave.
	type job struct {
		order int
		step  int
	}
	var jobs []job
	for o := 0; o < cfg.Orders; o++ {
		jobs = append(jobs, job{o, 0})
	}
	interval := time.Second / time.Duration(cfg.Rate)
	next := time.Now()
	for len(jobs) > 0 {
		if err := ctx.Err(); err != nil {
			return err
		}
		i := rand.IntN(min(len(jobs), 50))
		j := jobs[i]
		jobs = append(jobs[:i], jobs[i+1:]...)
		orderID := fmt.Sprintf("order-%s-%04d", runID, j.order)
		p := OrderPayload{OrderID: orderID, CustomerID: fmt.Sprintf("cust-%03d", j.order%97), AmountCents: int64(1000 + j.order%50*125), Currency: "EUR", Status: steps[j.step]}
		ev, err := envelope.New("order."+steps[j.step], "order", orderID, p)
		if err != nil {
			return err
		}
		ev.TenantID = "demo"
		ev.CorrelationID = orderID
		err = pgx.BeginFunc(ctx, d.Pool, func(tx pgx.Tx) error {
			if j.step == 0 {
				if _, err := tx.Exec(ctx, `INSERT INTO demo_orders (id, customer_id, amount_cents, status) VALUES ($1, $2, $3, $4)`,
					orderID, p.CustomerID, p.AmountCents, p.Status); err != nil {
					return err
				}
			} else if _, err := tx.Exec(ctx, `UPDATE demo_orders SET status = $2, updated_at = now() WHERE id = $1`, orderID, p.Status); err != nil {
				return err
			}
			return outbox.Enqueue(ctx, tx, ev)
		})
		if err != nil {
			return fmt.Errorf("demo transaction: %w", err)
		}
		enqueued.Add(1)
		for name, q := range d.Resources.Queues {
			if q.Consumer.Matches(ev.Attributes()) {
				expected[name].Add(1)
			}
		}
		if j.step+1 < len(steps) {
			jobs = append(jobs, job{j.order, j.step + 1})
		}
		next = next.Add(interval)
		if wait := time.Until(next); wait > 0 {
			time.Sleep(wait)
		}
	}
	return nil
}

func readQueue(ctx context.Context, c *sqs.Client, url, runID string, st *queueStats) {
	for ctx.Err() == nil {
		out, err := c.ReceiveMessage(ctx, &sqs.ReceiveMessageInput{
			QueueUrl: aws.String(url), MaxNumberOfMessages: 10, WaitTimeSeconds: 1,
		})
		if err != nil {
			time.Sleep(200 * time.Millisecond)
			continue
		}
		var del []sqstypes.DeleteMessageBatchRequestEntry
		for i, m := range out.Messages {
			del = append(del, sqstypes.DeleteMessageBatchRequestEntry{Id: aws.String(fmt.Sprint(i)), ReceiptHandle: m.ReceiptHandle})
			e, err := envelope.Decode([]byte(aws.ToString(m.Body)))
			if err != nil || !strings.Contains(e.AggregateID, runID) {
				continue // not this run's (left over from an interrupted run)
			}
			st.mu.Lock()
			switch {
			case st.seen[e.ID]:
				st.repeats.Add(1)
			case e.Sequence <= st.last[e.AggregateID]:
				st.violations.Add(1)
			default:
				st.last[e.AggregateID] = e.Sequence
				st.lat = append(st.lat, time.Since(e.OccurredAt))
				st.received.Add(1)
			}
			st.seen[e.ID] = true
			st.mu.Unlock()
		}
		if len(del) > 0 {
			_, _ = c.DeleteMessageBatch(context.Background(), &sqs.DeleteMessageBatchInput{QueueUrl: aws.String(url), Entries: del})
		}
	}
}

func allArrived(names []string, stats map[string]*queueStats, expected map[string]*atomic.Int64) bool {
	for _, n := range names {
		if stats[n].received.Load() < expected[n].Load() {
			return false
		}
	}
	return true
}

func progress(ctx context.Context, cfg Config, d Deps, names []string, stats map[string]*queueStats, enqueued *atomic.Int64, producing bool) {
	b, err := outbox.Stats(ctx, d.Pool)
	backlog := "?"
	age := "?"
	if err == nil {
		backlog = fmt.Sprint(b.Pending)
		age = b.OldestPendingAge.Round(time.Millisecond).String()
	}
	var qs []string
	for _, n := range names {
		qs = append(qs, fmt.Sprintf("%s %d", n, stats[n].received.Load()))
	}
	state := "producing"
	if !producing {
		state = "draining"
	}
	line := fmt.Sprintf("%s | enqueued %d | published %d | backlog %s | oldest pending %s | received: %s",
		state, enqueued.Load(), d.Dispatcher.Totals().Sent, backlog, age, strings.Join(qs, ", "))
	if cfg.Interactive {
		fmt.Fprintf(cfg.Out, "\r\033[K%s", line)
	} else {
		fmt.Fprintln(cfg.Out, line)
	}
}

func summary(w io.Writer, elapsed time.Duration, names []string, stats map[string]*queueStats, expected map[string]*atomic.Int64, enqueued *atomic.Int64, tot outbox.Totals) {
	fmt.Fprintf(w, "\nsummary: %d events in %d transactions over %s; dispatcher published %d (retried %d, dead %d)\n",
		enqueued.Load(), enqueued.Load(), elapsed.Round(time.Millisecond), tot.Sent, tot.Retried, tot.Dead)
	fmt.Fprintf(w, "%-20s %9s %9s %11s %8s %12s %12s\n", "queue", "expected", "received", "violations", "repeats", "p50 latency", "p99 latency")
	for _, n := range names {
		st := stats[n]
		st.mu.Lock()
		lat := append([]time.Duration(nil), st.lat...)
		st.mu.Unlock()
		sort.Slice(lat, func(i, j int) bool { return lat[i] < lat[j] })
		p := func(q float64) string {
			if len(lat) == 0 {
				return "-"
			}
			return lat[min(len(lat)-1, int(q*float64(len(lat))))].Round(time.Millisecond).String()
		}
		fmt.Fprintf(w, "%-20s %9d %9d %11d %8d %12s %12s\n", n, expected[n].Load(), st.received.Load(), st.violations.Load(), st.repeats.Load(), p(0.5), p(0.99))
	}
	fmt.Fprintln(w, "latency: event occurred_at (producer) to received from the queue. violations: an aggregate's event arrived before an earlier one.")
}
