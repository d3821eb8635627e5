package redrive_test

import (
	"strings"
	"testing"
	"time"

	"github.com/fifobox/fifobox/pkg/redrive"
)

// The formats operators type, through the one decoder the CLI and the
// Lambda share.
func TestDurationsAndTimes(t *testing.T) {
	now := time.Date(2026, 11, 27, 12, 0, 0, 0, time.UTC)
	durs := []struct {
		in   string
		want time.Duration
		bad  bool
	}{
		{"90s", 90 * time.Second, false}, {"24h", 24 * time.Hour, false}, {"7d", 7 * 24 * time.Hour, false},
		{"1d12h", 36 * time.Hour, false}, {"1.5d", 36 * time.Hour, false}, {"3600", time.Hour, false},
		{"a week", 0, true}, {"-1h", 0, true}, {"", 0, true}, {"7days", 0, true},
	}
	for _, d := range durs {
		got, err := redrive.ParseDuration(d.in)
		if (err != nil) != d.bad || got != d.want {
			t.Errorf("ParseDuration(%q) = %s, %v", d.in, got, err)
		}
	}
	times := []struct {
		in   string
		want time.Time
		bad  bool
	}{
		{"2026-11-01", time.Date(2026, 11, 1, 0, 0, 0, 0, time.UTC), false},
		{"2026-11-23T10:00:00Z", time.Date(2026, 11, 23, 10, 0, 0, 0, time.UTC), false},
		{"24h", now.Add(-24 * time.Hour), false}, {"7d", now.Add(-7 * 24 * time.Hour), false},
		{"yesterday", time.Time{}, true}, {"3600", time.Time{}, true}, {"2026-13-01", time.Time{}, true},
	}
	for _, tt := range times {
		got, err := redrive.ParseTime(tt.in, now)
		if (err != nil) != tt.bad || !got.Equal(tt.want) {
			t.Errorf("ParseTime(%q) = %s, %v", tt.in, got, err)
		}
	}
}

// A command's JSON: durations in seconds or as text, times in any accepted
// form; a field the operation does not take, a bad value, an old operation
// name: refused, naming the field.
func TestDecodeCommand(t *testing.T) {
	c, err := redrive.DecodeCommand([]byte(`{"operation":"prune","older_than":86400,"inbox_older_than":"30d","dry_run":true}`), "")
	if err != nil || time.Duration(c.OlderThan) != 24*time.Hour || time.Duration(c.InboxOlderThan) != 30*24*time.Hour || !c.DryRun {
		t.Fatalf("prune: %+v %v", c, err)
	}
	b, _ := c.JSON()
	if string(b) != `{"operation":"prune","dry_run":true,"older_than":86400,"inbox_older_than":2592000}` {
		t.Errorf("JSON %s: want durations in seconds", b)
	}
	c, err = redrive.DecodeCommand([]byte(`{"operation":"replay","consumer":"c","aggregate_type":"order","since":"2026-11-01"}`), "")
	if err != nil || c.Since == nil || !c.Since.Equal(time.Date(2026, 11, 1, 0, 0, 0, 0, time.UTC)) {
		t.Fatalf("replay: %+v %v", c, err)
	}
	for payload, field := range map[string]string{
		`{"operation":"redrive","consumer":"c","source":"dlq"}`:    "source",
		`{"operation":"dead-list","limit":-1}`:                     "limit",
		`{"operation":"dead-list","limit":1.5}`:                    "limit",
		`{"operation":"prune","older_than":"a week"}`:              "older_than",
		`{"operation":"prune","older_than":0}`:                     "older_than",
		`{"operation":"replay","consumer":"c","since":"tomorrow"}`: "since",
		`{"operation":"dlq-redrive","consumer":"c"}`:               `"dlq-redrive" is now "redrive"`,
		`{"operation":"requeue-dead"}`:                             `"requeue-dead" is now "dead-requeue"`,
		`{"operation":"status","request_id":"forged"}`:             "request_id",
		`{"operation":"status","consumer":["c"]}`:                  "consumer",
	} {
		_, err := redrive.DecodeCommand([]byte(payload), "")
		if err == nil || !strings.Contains(err.Error(), field) {
			t.Errorf("%s: %v, want an error naming %s", payload, err, field)
		}
	}
	if c, err := redrive.DecodeCommand(nil, redrive.OpMigrate); err != nil || c.Operation != redrive.OpMigrate {
		t.Errorf("empty payload: %+v %v, want the default operation", c, err)
	}
}
