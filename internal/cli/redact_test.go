package cli

import (
	"strings"
	"testing"
)

// TestDatabaseURLFlagNeverEchoesItsPassword: a malformed --database-url
// fails with an error (and output) that names the problem, not the password.
func TestDatabaseURLFlagNeverEchoesItsPassword(t *testing.T) {
	t.Setenv("FIFOBOX_REDRIVE_FUNCTION", "")
	for _, u := range []string{
		"postgres://fifobox:S3cr%zzet@127.0.0.1:5432/fifobox",
		"host=127.0.0.1 password=S3cr%zzet port=notaport",
	} {
		stdout, stderr, err := runCLI(t, "--database-url", u, "-v", "status")
		if err == nil {
			t.Fatalf("%s: no error", u)
		}
		for what, s := range map[string]string{"error": err.Error(), "stdout": stdout, "stderr": stderr} {
			if strings.Contains(s, "S3cr") || strings.Contains(s, "zzet") {
				t.Errorf("%s: the %s carries the password: %s", u, what, s)
			}
		}
		if !strings.Contains(err.Error(), "xxxxx") {
			t.Errorf("%s: error %q does not show the redacted value", u, err)
		}
	}
}
