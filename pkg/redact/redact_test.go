package redact

import (
	"errors"
	"fmt"
	"net/url"
	"strings"
	"testing"
)

func TestURL(t *testing.T) {
	for _, tc := range []struct{ in, want string }{
		{"amqps://fifobox:S3cret@host:5671/vh", "amqps://fifobox:xxxxx@host:5671/vh"},
		{"amqps://fifobox:S3cr%zzet@host", "amqps://fifobox:xxxxx@host"}, // not a valid URL
		{"amqp://u:p@ss/w@rd@host/vh", "amqp://u:xxxxx@host/vh"},         // unescaped '@' and '/'
		{"amqp://guest@127.0.0.1:5672/", "amqp://guest@127.0.0.1:5672/"}, // no password
		{"nats://s3cr3ttoken@host:4222", "nats://xxxxx@host:4222"},       // NATS token
		{"nats://a:b@h1:4222,nats://c:d@h2:4222", "nats://a:xxxxx@h1:4222,nats://c:xxxxx@h2:4222"},
		{"postgres://u@h/db?password=S3cret&sslmode=disable", "postgres://u@h/db?password=xxxxx&sslmode=disable"},
		{"amqp://127.0.0.1:5672/fifobox", "amqp://127.0.0.1:5672/fifobox"},
		{"not a url", "not a url"},
	} {
		if got := URL(tc.in); got != tc.want {
			t.Errorf("URL(%q) = %q, want %q", tc.in, got, tc.want)
		}
	}
}

func TestDSN(t *testing.T) {
	for _, tc := range []struct{ in, want string }{
		{"host=h user=u password=S3cret dbname=d", "host=h user=u password=xxxxx dbname=d"},
		{"host=h password='S3 cr\\'et' port=5432", "host=h password=xxxxx port=5432"},
		{"host=h sslpassword=S3cret", "host=h sslpassword=xxxxx"},
		{"postgres://u:S3cr%zzet@h/d", "postgres://u:xxxxx@h/d"},
	} {
		if got := DSN(tc.in); got != tc.want {
			t.Errorf("DSN(%q) = %q, want %q", tc.in, got, tc.want)
		}
	}
}

func TestErrorHidesEveryFormOfTheSecret(t *testing.T) {
	raw := "amqps://fifobox:S3cr%zzet@host"
	_, perr := url.Parse(raw)
	for _, tc := range []struct {
		name string
		err  error
	}{
		{"url.Parse quotes the input", perr},
		{"decoded form", fmt.Errorf("login as fifobox with %q failed", "S3cr\u00fcet")},
		{"secret alone", errors.New("bad password S3cr%zzet")},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got := Error(tc.err, raw, "amqp://u:S3cr%C3%BCet@h").Error()
			if strings.Contains(got, "S3cr") {
				t.Fatalf("secret in %q", got)
			}
		})
	}
}

func TestErrorKeepsCleanErrorsAsTheyAre(t *testing.T) {
	sentinel := errors.New("broker unavailable")
	err := fmt.Errorf("dial: %w", sentinel)
	got := Error(err, "amqp://u:S3cret@h")
	if got != err || !errors.Is(got, sentinel) {
		t.Fatalf("Error changed an error with no secret: %v", got)
	}
	if Error(nil) != nil {
		t.Fatal("Error(nil) != nil")
	}
	// One that had a secret keeps no path to it.
	dirty := fmt.Errorf("parse %q: %w", "amqp://u:S3cret@h", sentinel)
	r := Error(dirty, "amqp://u:S3cret@h")
	if errors.Unwrap(r) != nil || strings.Contains(r.Error(), "S3cret") {
		t.Fatalf("redacted error still reaches the secret: %v", r)
	}
}

func TestText(t *testing.T) {
	in := `connect "amqp://u:S3cret@h:5672/vh" then nats://tok3n@n:4222 with password=abc`
	got := Text(in)
	for _, s := range []string{"S3cret", "tok3n", "abc"} {
		if strings.Contains(got, s) {
			t.Errorf("Text left %q in %q", s, got)
		}
	}
	if !strings.Contains(got, "amqp://u:xxxxx@h:5672/vh") {
		t.Errorf("Text = %q: want the host and user kept", got)
	}
}

func TestSecrets(t *testing.T) {
	got := Secrets("amqp://u:S3cr%21t@h, host=x password='p w'")
	want := []string{"S3cr%21t", "S3cr!t", "p w"}
	if strings.Join(got, "|") != strings.Join(want, "|") {
		t.Fatalf("Secrets = %q, want %q", got, want)
	}
}
