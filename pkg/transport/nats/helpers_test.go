package nats_test

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"io"
	"log/slog"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	natsgo "github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/fifobox/fifobox/pkg/transport"
	nats "github.com/fifobox/fifobox/pkg/transport/nats"
	"github.com/fifobox/fifobox/pkg/transport/transporttest"
)

// quiet is a logger for tests that expect warnings (outages, retries).
var quiet = slog.New(slog.NewTextHandler(io.Discard, nil))

// serverURL is the NATS server the tests use: FIFOBOX_TEST_NATS_URL, default
// the local one. Tests never restart or reconfigure it; each works in
// streams and subjects of its own and deletes them.
func serverURL() string {
	if u := os.Getenv("FIFOBOX_TEST_NATS_URL"); u != "" {
		return u
	}
	return nats.DefaultURL
}

var (
	reachOnce sync.Once
	reachErr  error
)

// needServer skips the test when no NATS server with JetStream answers.
func needServer(tb testing.TB) {
	tb.Helper()
	reachOnce.Do(func() {
		nc, err := natsgo.Connect(serverURL(), natsgo.Timeout(2*time.Second))
		if err != nil {
			reachErr = err
			return
		}
		defer nc.Close()
		js, _ := jetstream.New(nc)
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		defer cancel()
		_, reachErr = js.AccountInfo(ctx)
	})
	if reachErr != nil {
		tb.Skipf("no NATS server with JetStream at %s (set FIFOBOX_TEST_NATS_URL, or start nats-server -js): %v", serverURL(), reachErr)
	}
}

// isolate gives topo a stream, dead-letter stream and subject prefix of its
// own, so tests run in parallel without seeing each other's data, and
// deletes the streams when the test ends.
func isolate(tb testing.TB, topo nats.Topology) nats.Topology {
	tb.Helper()
	b := make([]byte, 6)
	_, _ = rand.Read(b)
	id := hex.EncodeToString(b)
	topo.Stream = "T" + id + "_" + topo.Stream
	topo.DeadLetterStream = ""
	topo.SubjectPrefix = "t" + id + "." + topo.SubjectPrefix
	dlq := topo.Stream + "_DLQ"
	tb.Cleanup(func() {
		nc, err := natsgo.Connect(serverURL())
		if err != nil {
			return
		}
		defer nc.Close()
		js, _ := jetstream.New(nc)
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		_ = js.DeleteStream(ctx, topo.Stream)
		_ = js.DeleteStream(ctx, dlq)
	})
	return topo
}

// setup isolates topo, provisions it and returns the config.
func setup(tb testing.TB, topo nats.Topology) nats.Config {
	tb.Helper()
	needServer(tb)
	cfg := nats.Config{URL: serverURL(), Topology: isolate(tb, topo), Logger: quiet, ReconnectMaxDelay: 500 * time.Millisecond}
	p, err := nats.NewProvisioner(cfg)
	if err != nil {
		tb.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if err := p.Provision(ctx); err != nil {
		tb.Fatal(err)
	}
	return cfg
}

func newPublisher(tb testing.TB, cfg nats.Config) *nats.Publisher {
	tb.Helper()
	p, err := nats.NewPublisher(cfg)
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { _ = p.Close() })
	return p
}

// newEvent and message are transporttest's: an event of one aggregate with
// sequence seq, and an event as the dispatcher hands it to a publisher.
var (
	newEvent = transporttest.Event
	message  = transporttest.Message
)

// raw is a test's own connection, for inspecting streams.
type raw struct {
	tb testing.TB
	nc *natsgo.Conn
	js jetstream.JetStream
}

func dialRaw(tb testing.TB) *raw {
	tb.Helper()
	nc, err := natsgo.Connect(serverURL())
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(nc.Close)
	js, err := jetstream.New(nc)
	if err != nil {
		tb.Fatal(err)
	}
	return &raw{tb: tb, nc: nc, js: js}
}

// msgs is the number of messages in the stream.
func (r *raw) msgs(stream string) uint64 {
	r.tb.Helper()
	s, err := r.js.Stream(context.Background(), stream)
	if err != nil {
		r.tb.Fatalf("stream %s: %v", stream, err)
	}
	return s.CachedInfo().State.Msgs
}

// all reads every message of stream with a subject matching filter, in order.
func (r *raw) all(stream, filter string) []jetstream.Msg {
	r.tb.Helper()
	ctx := context.Background()
	c, err := r.js.OrderedConsumer(ctx, stream, jetstream.OrderedConsumerConfig{FilterSubjects: []string{filter}})
	if err != nil {
		r.tb.Fatalf("ordered consumer on %s: %v", stream, err)
	}
	var out []jetstream.Msg
	for {
		b, err := c.Fetch(100, jetstream.FetchMaxWait(500*time.Millisecond))
		if err != nil {
			r.tb.Fatalf("fetch %s: %v", stream, err)
		}
		n := 0
		for m := range b.Messages() {
			out = append(out, m)
			n++
		}
		if n == 0 {
			return out
		}
	}
}

// eventually polls cond until it holds or the timeout passes.
func eventually(tb testing.TB, timeout time.Duration, what string, cond func() bool) {
	tb.Helper()
	deadline := time.Now().Add(timeout)
	for !cond() {
		if time.Now().After(deadline) {
			tb.Fatalf("timed out after %s waiting for %s", timeout, what)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// fastRetry is a retry policy for tests: n retries at 50ms, 100ms, 200ms...
func fastRetry(n int) transport.RetryPolicy {
	return transport.RetryPolicy{MaxRetries: n, InitialDelay: transport.Duration(50 * time.Millisecond), Multiplier: 2, MaxDelay: transport.Duration(time.Second)}
}

// newProxy is a transporttest.Proxy in front of the NATS server: a test
// cuts (Cut), pauses (Pause, Resume) or partitions it without touching the
// server; proxyURL is its address as a NATS URL.
func newProxy(tb testing.TB) *transporttest.Proxy {
	tb.Helper()
	return transporttest.NewProxy(tb, strings.TrimPrefix(serverURL(), "nats://"))
}

func proxyURL(p *transporttest.Proxy) string { return "nats://" + p.Addr() }
