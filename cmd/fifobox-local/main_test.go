package main

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"io"
	"log/slog"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	natsgo "github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/fifobox/fifobox/internal/emulatortest"
	"github.com/fifobox/fifobox/internal/pgtest"
	"github.com/fifobox/fifobox/pkg/envelope"
	"github.com/fifobox/fifobox/pkg/outbox"
	"github.com/fifobox/fifobox/pkg/transport/amqp/amqptest"
	"github.com/fifobox/fifobox/pkg/transport/nats"
)

// These tests run what `make local` runs, against PostgreSQL and the
// emulator, each in a fresh schema and under its own topology prefix. They
// set the AWS environment the way localstack/env.sh does, so they cannot run
// in parallel with each other.

func demoOptions(t *testing.T, orders, rate int) (options, *bytes.Buffer, *pgtest.DB) {
	t.Helper()
	t.Setenv("AWS_ENDPOINT_URL", emulatortest.Endpoint(t))
	t.Setenv("AWS_REGION", "us-east-1")
	t.Setenv("AWS_ACCESS_KEY_ID", "test")
	t.Setenv("AWS_SECRET_ACCESS_KEY", "test")
	db := pgtest.NewEmpty(t)
	b := make([]byte, 4)
	_, _ = rand.Read(b)
	t.Setenv("FIFOBOX_SNS_NAME_PREFIX", "t"+hex.EncodeToString(b)+"-")
	out := &bytes.Buffer{}
	return options{
		dbURL: db.URL, orders: orders, rate: rate, period: time.Second,
		metricsPath: filepath.Join(t.TempDir(), "metrics.emf.jsonl"), out: out,
	}, out, db
}

var (
	summaryRe   = regexp.MustCompile(`(?m)^summary: (\d+) events`)
	readModelRe = regexp.MustCompile(`(?m)^read model \(orders-projection\): (\d+) orders, (\d+) shipped, (\d+) events applied \(want (\d+), (\d+), (\d+):`)
	consumerRe  = regexp.MustCompile(`(?m)^(audit|orders-projection|shipping)\s+(\d+)\s+(\d+)\s+(\d+)\s`)
)

func ints(t *testing.T, re *regexp.Regexp, out string) []int {
	t.Helper()
	m := re.FindStringSubmatch(out)
	if m == nil {
		t.Fatalf("output has no line matching %s:\n%s", re, out)
	}
	var n []int
	for _, s := range m[1:] {
		if v, err := strconv.Atoi(s); err == nil {
			n = append(n, v)
		}
	}
	return n
}

func TestLocalDemoRunsEndToEnd(t *testing.T) {
	o, out, _ := demoOptions(t, 25, 200)
	runDemo(t, o, out)
}

// make local with FIFOBOX_TRANSPORT=rabbitmq: the same demo through the
// machine's RabbitMQ, in a vhost of the test's own.
func TestLocalDemoThroughRabbitMQ(t *testing.T) {
	v := amqptest.New(t)
	t.Setenv("FIFOBOX_TRANSPORT", "rabbitmq")
	t.Setenv("FIFOBOX_AMQP_URL", v.URL)
	runDemo(t, brokerDemoOptions(t, 25, 200), nil)
}

// make local with FIFOBOX_TRANSPORT=nats: the same demo through the
// machine's NATS JetStream, in a stream and subject prefix of the test's own.
func TestLocalDemoThroughNATS(t *testing.T) {
	url := nats.DefaultURL
	nc, err := natsgo.Connect(url, natsgo.Timeout(2*time.Second))
	if err != nil {
		t.Skipf("no NATS server at %s: %v", url, err)
	}
	defer nc.Close()
	b := make([]byte, 6)
	_, _ = rand.Read(b)
	id := hex.EncodeToString(b)
	stream := "T" + id + "_LOCAL"
	t.Cleanup(func() {
		js, _ := jetstream.New(nc)
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		_ = js.DeleteStream(ctx, stream)
		_ = js.DeleteStream(ctx, stream+"_DLQ")
	})
	t.Setenv("FIFOBOX_TRANSPORT", "nats")
	t.Setenv("FIFOBOX_NATS_URL", url)
	t.Setenv("FIFOBOX_NATS_STREAM", stream)
	t.Setenv("FIFOBOX_NATS_SUBJECT_PREFIX", "t"+id+".local")
	runDemo(t, brokerDemoOptions(t, 25, 200), nil)
}

func brokerDemoOptions(t *testing.T, orders, rate int) options {
	db := pgtest.NewEmpty(t)
	return options{dbURL: db.URL, orders: orders, rate: rate, period: time.Second,
		metricsPath: filepath.Join(t.TempDir(), "metrics.emf.jsonl"), out: &bytes.Buffer{}}
}

// runDemo runs the demo of 25 orders and checks its summary: every event
// applied once by each consumer that selects it, in order, and the read model.
func runDemo(t *testing.T, o options, out *bytes.Buffer) {
	t.Helper()
	if out == nil {
		out = o.out.(*bytes.Buffer)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	if err := run(ctx, o, slog.New(slog.NewTextHandler(io.Discard, nil))); err != nil {
		t.Fatalf("run: %v\n%s", err, out)
	}
	s := out.String()
	if got := ints(t, summaryRe, s); got[0] != 75 {
		t.Errorf("summary: %d events, want 75", got[0])
	}
	if got := ints(t, readModelRe, s); got[0] != 25 || got[1] != 25 || got[2] != 75 || got[3] != 25 || got[4] != 25 || got[5] != 75 {
		t.Errorf("read model line %v, want 25 orders, 25 shipped, 75 applied, against 25, 25, 75", got)
	}
	// Each consumer: applied == expected, no order violations.
	want := map[string]int{"audit": 75, "orders-projection": 75, "shipping": 25}
	for _, m := range consumerRe.FindAllStringSubmatch(s, -1) {
		exp, _ := strconv.Atoi(m[2])
		applied, _ := strconv.Atoi(m[3])
		if exp != want[m[1]] || applied != exp || m[4] != "0" {
			t.Errorf("%s: expected %d, applied %d, violations %s; want %d, %d, 0", m[1], exp, applied, m[4], want[m[1]], want[m[1]])
		}
		delete(want, m[1])
	}
	if len(want) > 0 {
		t.Errorf("no summary line for %v:\n%s", want, s)
	}
}

// Ctrl-C stops the producer early: run returns nil, the summary expects
// what was enqueued (not the orders asked for), and every counted event is
// in the outbox.
func TestLocalDemoInterrupted(t *testing.T) {
	o, out, db := demoOptions(t, 5000, 100)
	ctx, cancel := context.WithCancel(context.Background())
	time.AfterFunc(3*time.Second, cancel)
	if err := run(ctx, o, slog.New(slog.NewTextHandler(io.Discard, nil))); err != nil {
		t.Fatalf("run after Ctrl-C: %v\n%s", err, out)
	}
	s := out.String()
	if !regexp.MustCompile(`(?m)^interrupted: `).MatchString(s) {
		t.Errorf("no interrupted line:\n%s", s)
	}
	events := ints(t, summaryRe, s)[0]
	if events == 0 || events >= 3*5000 {
		t.Fatalf("summary: %d events; want some, fewer than the 15000 asked for", events)
	}
	rm := ints(t, readModelRe, s)
	wantOrders, wantShipped, wantApplied := rm[3], rm[4], rm[5]
	if wantApplied != events || wantOrders == 0 || wantOrders > events || wantShipped > wantOrders {
		t.Errorf("read model expects %d orders, %d shipped, %d events; enqueued %d events", wantOrders, wantShipped, wantApplied, events)
	}
	var rows, created, shipped int
	err := db.Pool.QueryRow(context.Background(), `SELECT count(*), count(*) FILTER (WHERE event_type = 'order.created'),
		count(*) FILTER (WHERE event_type = 'order.shipped') FROM outbox`).Scan(&rows, &created, &shipped)
	if err != nil && err != pgx.ErrNoRows {
		t.Fatal(err)
	}
	if rows != events || created != wantOrders || shipped != wantShipped {
		t.Errorf("outbox holds %d events (%d created, %d shipped); the summary counted %d (%d, %d)", rows, created, shipped, events, wantOrders, wantShipped)
	}
}

// lockedBuffer is a buffer the demo writes while the test reads it.
type lockedBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *lockedBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *lockedBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

// make local's default: after the demo drained, the pipeline stays up (an
// event written meanwhile is published and applied, and a line says so)
// until Ctrl-C, and then stops cleanly.
func TestLocalDemoStaysUpUntilCtrlC(t *testing.T) {
	o, _, db := demoOptions(t, 10, 200)
	out := &lockedBuffer{}
	o.out, o.stayUp = out, true
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- run(ctx, o, slog.New(slog.NewTextHandler(io.Discard, nil))) }()
	wait := func(what string, cond func(string) bool) {
		t.Helper()
		deadline := time.Now().Add(90 * time.Second)
		for !cond(out.String()) {
			if time.Now().After(deadline) {
				cancel()
				t.Fatalf("never %s:\n%s", what, out)
			}
			time.Sleep(100 * time.Millisecond)
		}
	}
	wait("stayed up", func(s string) bool { return strings.Contains(s, "the pipeline stays up") })
	select {
	case err := <-done:
		t.Fatalf("run returned after the demo (%v) instead of staying up:\n%s", err, out)
	default:
	}
	e, err := envelope.New("order.created", "order", "order-late", map[string]string{"order_id": "order-late"})
	if err != nil {
		t.Fatal(err)
	}
	if err := pgx.BeginFunc(context.Background(), db.Pool, func(tx pgx.Tx) error { return outbox.Enqueue(context.Background(), tx, e) }); err != nil {
		t.Fatal(err)
	}
	wait("applied the late event", func(string) bool {
		var n int
		_ = db.Pool.QueryRow(context.Background(), `SELECT count(*) FROM orders_read_model WHERE order_id = 'order-late'`).Scan(&n)
		return n == 1
	})
	wait("printed an up line", func(s string) bool { return strings.Contains(s, "\nup | ") })
	cancel()
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("run after Ctrl-C: %v\n%s", err, out)
		}
	case <-time.After(60 * time.Second):
		t.Fatal("did not stop after Ctrl-C")
	}
	if !strings.HasSuffix(out.String(), "stopped\n") {
		t.Errorf("no stopped line:\n%s", out)
	}
}
