package transport_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/fifobox/fifobox/internal/pgtest"
	"github.com/fifobox/fifobox/pkg/envelope"
	"github.com/fifobox/fifobox/pkg/inbox"
	"github.com/fifobox/fifobox/pkg/transport"
)

func TestParseKind(t *testing.T) {
	tests := []struct {
		in   string
		want transport.Kind
		err  bool
	}{
		{"", transport.SNS, false},
		{"sns", transport.SNS, false},
		{"RabbitMQ", transport.RabbitMQ, false},
		{" nats ", transport.NATS, false},
		{"kafka", "", true},
	}
	for _, tt := range tests {
		got, err := transport.ParseKind(tt.in)
		if (err != nil) != tt.err || got != tt.want {
			t.Errorf("ParseKind(%q) = %q, %v; want %q, error %v", tt.in, got, err, tt.want, tt.err)
		}
	}
}

func TestKindFromEnvNamesTheVariable(t *testing.T) {
	t.Setenv(transport.EnvTransport, "kafka")
	_, err := transport.KindFromEnv()
	if err == nil || !strings.Contains(err.Error(), "FIFOBOX_TRANSPORT") {
		t.Fatalf("error %v does not name FIFOBOX_TRANSPORT", err)
	}
	t.Setenv(transport.EnvTransport, "")
	if k, err := transport.KindFromEnv(); err != nil || k != transport.SNS {
		t.Fatalf("unset: got %q, %v; want sns (the default)", k, err)
	}
}

func TestRetryPolicy(t *testing.T) {
	p := transport.RetryPolicy{MaxRetries: 3, InitialDelay: transport.Duration(time.Second), Multiplier: 2, MaxDelay: transport.Duration(3 * time.Second)}
	want := []time.Duration{time.Second, 2 * time.Second, 3 * time.Second, 3 * time.Second}
	for i, w := range want {
		if got := p.Delay(i + 1); got != w {
			t.Errorf("Delay(%d) = %s, want %s", i+1, got, w)
		}
	}
	if d := (transport.RetryPolicy{}).WithDefaults(); d.MaxRetries != 5 || d.Delay(1) != time.Second || d.Delay(20) != 5*time.Minute {
		t.Errorf("defaults: %+v", d)
	}
	if d := (transport.RetryPolicy{MaxRetries: 0, InitialDelay: transport.Duration(time.Second)}).WithDefaults(); d.MaxRetries != 0 {
		t.Errorf("an explicit policy with no retries got %d retries", d.MaxRetries)
	}
	bad := []transport.RetryPolicy{
		{MaxRetries: -1, InitialDelay: 1e9, Multiplier: 2, MaxDelay: 1e9},
		{MaxRetries: 1, InitialDelay: 0, Multiplier: 2, MaxDelay: 1e9},
		{MaxRetries: 1, InitialDelay: 1e9, Multiplier: 0.5, MaxDelay: 1e9},
		{MaxRetries: 1, InitialDelay: 2e9, Multiplier: 2, MaxDelay: 1e9},
	}
	for _, b := range bad {
		if b.Validate() == nil {
			t.Errorf("%+v: Validate accepted it", b)
		}
	}
}

func TestDurationJSON(t *testing.T) {
	var p transport.RetryPolicy
	if err := json.Unmarshal([]byte(`{"max_retries":3,"initial_delay":"250ms","multiplier":2,"max_delay":"1m"}`), &p); err != nil {
		t.Fatal(err)
	}
	if p.Delay(1) != 250*time.Millisecond || time.Duration(p.MaxDelay) != time.Minute {
		t.Fatalf("decoded %+v", p)
	}
	b, _ := json.Marshal(p)
	if !strings.Contains(string(b), `"initial_delay":"250ms"`) {
		t.Fatalf("encoded %s", b)
	}
	if err := json.Unmarshal([]byte(`{"initial_delay":5}`), &p); err == nil {
		t.Fatal("a number was accepted as a duration")
	}
}

func TestLanesKeepOrderPerKey(t *testing.T) {
	l := transport.NewLanes(4, 8)
	var mu sync.Mutex
	got := map[string][]int{}
	lanes := map[string]map[int]bool{}
	for i := 0; i < 400; i++ {
		key := fmt.Sprintf("agg-%d", i%13)
		if err := l.Submit(context.Background(), key, func(lane int) {
			mu.Lock()
			defer mu.Unlock()
			got[key] = append(got[key], i)
			if lanes[key] == nil {
				lanes[key] = map[int]bool{}
			}
			lanes[key][lane] = true
		}); err != nil {
			t.Fatal(err)
		}
	}
	l.Close()
	for key, seq := range got {
		for j := 1; j < len(seq); j++ {
			if seq[j] < seq[j-1] {
				t.Fatalf("%s ran out of order: %v", key, seq)
			}
		}
		if len(lanes[key]) != 1 {
			t.Fatalf("%s ran on lanes %v", key, lanes[key])
		}
	}
	if len(got) != 13 {
		t.Fatalf("%d keys ran, want 13", len(got))
	}
}

func TestLanesSubmitStopsWithContext(t *testing.T) {
	l := transport.NewLanes(1, 0)
	block := make(chan struct{})
	_ = l.Submit(context.Background(), "a", func(int) { <-block })
	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel()
	if err := l.Submit(ctx, "a", func(int) {}); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("Submit on a full lane returned %v, want the context's error", err)
	}
	close(block)
	l.Close()
}

func event(t *testing.T) envelope.Envelope {
	t.Helper()
	e, err := envelope.New("order.created", "order", "o-"+uuid.NewString()[:8], map[string]int{"n": 1})
	if err != nil {
		t.Fatal(err)
	}
	e.Sequence = 1
	return e
}

func TestProcess(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	ctx := context.Background()
	ok := func(context.Context, pgx.Tx, envelope.Envelope) error { return nil }
	e := event(t)
	body, _ := e.Encode()

	tests := []struct {
		name    string
		body    []byte
		apply   inbox.Apply
		verdict transport.Verdict
		outcome inbox.Outcome
		class   string
	}{
		{"applied", body, ok, transport.Ack, inbox.Applied, ""},
		{"duplicate", body, ok, transport.Ack, inbox.Duplicate, ""},
		{"invalid", []byte(`{"v":1,"id":"x"}`), ok, transport.DeadLetter, 0, inbox.ClassInvalid},
		{"permanent", mustEncode(t, event(t)), func(context.Context, pgx.Tx, envelope.Envelope) error {
			return envelope.Permanent(errors.New("no such customer"))
		}, transport.DeadLetter, 0, inbox.ClassPermanent},
		{"transient", mustEncode(t, event(t)), func(context.Context, pgx.Tx, envelope.Envelope) error {
			return errors.New("downstream timeout")
		}, transport.Retry, 0, inbox.ClassTransient},
		{"panic", mustEncode(t, event(t)), func(context.Context, pgx.Tx, envelope.Envelope) error {
			panic("boom")
		}, transport.Retry, 0, inbox.ClassTransient},
	}
	for _, tt := range tests {
		r := transport.Process(ctx, db.Pool, "c1", tt.body, tt.apply)
		if r.Verdict != tt.verdict || r.Outcome != tt.outcome || r.Class != tt.class {
			t.Errorf("%s: got %s/%s/%q (%v), want %s/%s/%q", tt.name, r.Verdict, r.Outcome, r.Class, r.Err, tt.verdict, tt.outcome, tt.class)
		}
		if tt.verdict != transport.Ack && r.Err == nil {
			t.Errorf("%s: no error", tt.name)
		}
	}
	// A failed side effect leaves no inbox row: the retry applies it.
	var n int
	if err := db.Pool.QueryRow(ctx, `SELECT count(*) FROM inbox WHERE consumer = 'c1'`).Scan(&n); err != nil || n != 1 {
		t.Fatalf("inbox rows = %d (%v), want 1 (only the applied event)", n, err)
	}
}

func mustEncode(t *testing.T, e envelope.Envelope) []byte {
	t.Helper()
	b, err := e.Encode()
	if err != nil {
		t.Fatal(err)
	}
	return b
}
