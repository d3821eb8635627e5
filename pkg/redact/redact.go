// Package redact keeps secrets out of errors and logs. Every path that
// formats or parses a connection string (a PostgreSQL DSN, an AMQP or NATS
// URL, a URL built from a Secrets Manager secret) passes it, and any error
// that may quote it, through here first.
//
// It works on malformed input too: Go's url.Parse quotes the whole input in
// its error ("parse \"amqps://u:S3cr%zzet@host\": invalid URL escape"), so a
// parse error is exactly where a password would otherwise leak. Redaction
// errs on the side of hiding more (a password holding '@' or spaces may take
// a neighbouring word with it), never less.
package redact

import (
	"errors"
	"net/url"
	"regexp"
	"strings"
)

// Mask replaces a secret (the form pgx uses for DSNs).
const Mask = "xxxxx"

// URL returns s, one URL or a comma-separated list of them (NATS), with each
// password replaced by Mask. For the NATS schemes (nats, tls, ws, wss) a
// user name without a password is a token and is masked too. s need not
// parse.
func URL(s string) string {
	parts := strings.Split(s, ",")
	for i, p := range parts {
		parts[i] = oneURL(p)
	}
	return Query(strings.Join(parts, ","))
}

// oneURL masks the userinfo secret of one URL.
func oneURL(s string) string {
	scheme, rest, ok := strings.Cut(s, "://")
	if !ok {
		return s
	}
	at := strings.LastIndex(rest, "@")
	if at < 0 {
		return s
	}
	info := rest[:at]
	user, _, hasPass := strings.Cut(info, ":")
	switch {
	case hasPass:
		info = user + ":" + Mask
	case tokenScheme(scheme):
		info = Mask
	default:
		return s
	}
	return scheme + "://" + info + rest[at:]
}

// tokenScheme: schemes whose user-only userinfo is a token (NATS).
func tokenScheme(scheme string) bool {
	switch strings.ToLower(strings.TrimSpace(scheme)) {
	case "nats", "tls", "ws", "wss":
		return true
	}
	return false
}

// secretKey matches the keys of key=value settings that hold secrets.
const secretKey = `(?i)(?:password|passwd|pwd|sslpassword|secret|token|auth_token)`

var (
	// key='quoted value' or key=value in a PostgreSQL key/value DSN, or
	// key=value in a URL query.
	kvQuoted = regexp.MustCompile(secretKey + `\s*=\s*'(?:[^'\\]|\\.)*'`)
	kvPlain  = regexp.MustCompile(secretKey + `\s*=\s*[^\s&'#]+`)
	// scheme://user:password@ in free text; the password runs to the last
	// '@' before whitespace (more rather than less).
	inText = regexp.MustCompile(`([A-Za-z][A-Za-z0-9+.-]*://)([^\s/:@,]*):([^\s,]*)@`)
	// A NATS URL with a token: nats://token@host.
	tokenInText = regexp.MustCompile(`((?i:nats|tls|wss?)://)([^\s/:@,]+)@`)
)

// Query masks the values of secret settings (password=..., sslpassword=...,
// token=...) in a key/value DSN or a URL's query string.
func Query(s string) string {
	s = kvQuoted.ReplaceAllStringFunc(s, maskValue)
	return kvPlain.ReplaceAllStringFunc(s, maskValue)
}

func maskValue(kv string) string {
	i := strings.IndexByte(kv, '=')
	return kv[:i+1] + Mask
}

// DSN returns a PostgreSQL connection string (a URL or key/value pairs)
// with its passwords masked.
func DSN(s string) string {
	if strings.Contains(s, "://") {
		return URL(s)
	}
	return Query(s)
}

// Text masks what looks like a credential in free text: URL passwords,
// NATS tokens in URLs and secret key=value settings.
func Text(s string) string {
	s = inText.ReplaceAllString(s, "${1}${2}:"+Mask+"@")
	s = tokenInText.ReplaceAllString(s, "${1}"+Mask+"@")
	return Query(s)
}

// Error returns err with every secret removed from its message: the secrets
// of each connection string in raw (its password, raw and percent-decoded,
// or a NATS token; a value that is neither a URL nor key=value settings is
// taken as a secret itself), and whatever Text finds. An error with nothing to hide
// is returned as it is (errors.Is and errors.As keep working); one with
// something hidden becomes a plain error with the scrubbed message, keeping
// no reference to the original, so no caller reaches the secret through
// errors.Unwrap. Wrap a sentinel around the result (fmt.Errorf("%w: %v",
// ErrX, redact.Error(err, u))) where callers test for one. Error(nil) is nil.
func Error(err error, raw ...string) error {
	if err == nil {
		return nil
	}
	orig := err.Error()
	msg := orig
	for _, r := range raw {
		if r == "" {
			continue
		}
		secrets := Secrets(r)
		if len(secrets) == 0 && !strings.Contains(r, "://") {
			secrets = []string{r} // a password or token by itself
		}
		msg = strings.ReplaceAll(msg, r, URL(r))
		for _, s := range secrets {
			msg = strings.ReplaceAll(msg, s, Mask)
		}
	}
	if msg = Text(msg); msg == orig {
		return err
	}
	return errors.New(msg)
}

// Secrets returns the secret parts of a connection string: each URL's
// password (as written and percent-decoded) or NATS token, and the values of
// secret key=value settings. Empty for a string with none.
func Secrets(raw string) []string {
	var out []string
	add := func(s string) {
		if s != "" {
			out = append(out, s)
			if d, err := url.PathUnescape(s); err == nil && d != s {
				out = append(out, d)
			}
		}
	}
	for _, p := range strings.Split(raw, ",") {
		scheme, rest, ok := strings.Cut(strings.TrimSpace(p), "://")
		if !ok {
			continue
		}
		at := strings.LastIndex(rest, "@")
		if at < 0 {
			continue
		}
		user, pass, hasPass := strings.Cut(rest[:at], ":")
		switch {
		case hasPass:
			add(pass)
		case tokenScheme(scheme):
			add(user)
		}
	}
	for _, re := range []*regexp.Regexp{kvQuoted, kvPlain} {
		for _, kv := range re.FindAllString(raw, -1) {
			v := strings.TrimSpace(kv[strings.IndexByte(kv, '=')+1:])
			add(strings.Trim(v, "'"))
		}
	}
	return out
}
