package amqp_test

import (
	"context"
	"io"
	"log/slog"
	"testing"
	"time"

	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/fifobox/fifobox/pkg/transport"
	"github.com/fifobox/fifobox/pkg/transport/amqp"
	"github.com/fifobox/fifobox/pkg/transport/amqp/amqptest"
	"github.com/fifobox/fifobox/pkg/transport/transporttest"
)

// quiet is a logger for tests that expect warnings (outages, retries).
var quiet = slog.New(slog.NewTextHandler(io.Discard, nil))

// setup creates a vhost, provisions topo in it and returns the config.
func setup(t *testing.T, topo amqp.Topology) (amqp.Config, *amqptest.Vhost) {
	t.Helper()
	v := amqptest.New(t)
	cfg := amqp.Config{URL: v.URL, Topology: topo, Logger: quiet, ReconnectMaxDelay: 500 * time.Millisecond}
	p, err := amqp.NewProvisioner(cfg)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if err := p.Provision(ctx); err != nil {
		t.Fatal(err)
	}
	return cfg, v
}

func newPublisher(t *testing.T, cfg amqp.Config) *amqp.Publisher {
	t.Helper()
	p, err := amqp.NewPublisher(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = p.Close() })
	return p
}

// newEvent and message are transporttest's: an event of one aggregate with
// sequence seq, and an event as the dispatcher hands it to a publisher.
var (
	newEvent = transporttest.Event
	message  = transporttest.Message
)

// raw is a test's own connection to the vhost, for inspecting queues.
type raw struct {
	t    *testing.T
	conn *amqp091.Connection
}

func dialRaw(t *testing.T, url string) *raw {
	t.Helper()
	c, err := amqp091.Dial(url)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = c.Close() })
	return &raw{t: t, conn: c}
}

// depth is the queue's ready count; -1 if it does not exist.
func (r *raw) depth(q string) int {
	r.t.Helper()
	ch, err := r.conn.Channel()
	if err != nil {
		r.t.Fatal(err)
	}
	defer ch.Close()
	st, err := ch.QueueDeclarePassive(q, true, false, false, false, nil)
	if err != nil {
		return -1
	}
	return st.Messages
}

// get consumes every message waiting in q (acknowledging them). It
// consumes rather than uses basic.get, which quorum queues with single
// active consumer refuse.
func (r *raw) get(q string) []amqp091.Delivery {
	r.t.Helper()
	want := r.depth(q)
	ch, err := r.conn.Channel()
	if err != nil {
		r.t.Fatal(err)
	}
	defer ch.Close()
	ds, err := ch.Consume(q, "", true, false, false, false, nil)
	if err != nil {
		r.t.Fatalf("consume %s: %v", q, err)
	}
	var out []amqp091.Delivery
	for {
		idle := 300 * time.Millisecond
		if len(out) < want {
			idle = 5 * time.Second
		}
		select {
		case d, ok := <-ds:
			if !ok {
				return out
			}
			out = append(out, d)
		case <-time.After(idle):
			return out
		}
	}
}

// eventually polls cond until it holds or the timeout passes.
func eventually(t *testing.T, timeout time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %s waiting for %s", timeout, what)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// fastRetry is a retry policy for tests: n retries at 50ms, 100ms, 200ms...
func fastRetry(n int) transport.RetryPolicy {
	return transport.RetryPolicy{MaxRetries: n, InitialDelay: transport.Duration(50 * time.Millisecond), Multiplier: 2, MaxDelay: transport.Duration(time.Second)}
}

// amqpPublishing is a raw persistent message with an id.
func amqpPublishing(id string, body []byte) amqp091.Publishing {
	return amqp091.Publishing{MessageId: id, Body: body, DeliveryMode: amqp091.Persistent, Headers: amqp091.Table{}}
}
