package transport_test

import (
	"encoding/json"
	"strings"
	"testing"
	"time"

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
